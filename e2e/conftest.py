"""The real local cluster for every test in e2e/: started once per session, or reused when it is up."""

from __future__ import annotations

import uuid

import pytest

from flotilla.cluster.control_plane import ClusterConfig, down, status, up
from flotilla.cluster.paths import default_state_dir
from flotilla.cluster.testing import ClusterHandle, wait_for


def _running(state_dir) -> bool:
    return all(c["running"] for c in status(state_dir)["components"].values())


@pytest.fixture(scope="session")
def cluster() -> ClusterHandle:
    """Reuses the cluster `flotilla cluster up` runs, or starts a fresh one of its own and purges it after."""
    state_dir = default_state_dir()
    if _running(state_dir):
        handle = ClusterHandle(ClusterConfig.load(state_dir), started_here=False)
    else:
        state_dir = state_dir.parent / "test-cluster"
        down(state_dir, purge=True)  # whatever an interrupted run left behind, stopped by pid
        handle = ClusterHandle(up(ClusterConfig(state_dir=state_dir)), started_here=True)
    wait_for(
        lambda: handle.kubectl("get", "nodes", "-o", "name", check=False).stdout.count("node/") >= 2,
        60,
        "the node agent's nodes to register",
    )
    wait_for(
        lambda: (
            "True True"
            in " ".join(
                handle.kubectl(
                    "get",
                    "nodes",
                    "-o",
                    "jsonpath={.items[*].status.conditions[?(@.type=='Ready')].status}",
                    check=False,
                ).stdout.split()[:2]
            )
        ),
        90,
        "nodes to become Ready",
    )
    yield handle
    if handle.started_here:
        down(state_dir, purge=True)


@pytest.fixture
def namespace(cluster: ClusterHandle):
    """A fresh namespace per test, deleted afterwards (without waiting for finalization)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    wait_for(
        lambda: (
            "default"
            in cluster.kubectl("get", "serviceaccount", "-n", name, "-o", "name", check=False).stdout
        ),
        30,
        f"the default ServiceAccount in {name}",
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
