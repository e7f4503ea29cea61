"""The real local cluster for every test in e2e/: one of its own per session, on free ports."""

from __future__ import annotations

import os
import sysconfig
import uuid
from collections.abc import Iterator

import pytest

from flotilla.cluster.control_plane import ClusterConfig, down, up
from flotilla.cluster.handle import ClusterHandle, free_port, wait_for
from flotilla.cluster.paths import default_state_dir

# Pods get 127.7.x.y (the default cluster uses 127.1.x.y); two suites at once need different bases, and
# different FLOTILLA_CLUSTER_DIR parents.
TEST_POD_IP_BASE = int(os.environ.get("FLOTILLA_TEST_POD_IP_BASE", "7"))


def _path_without_scripts_dir() -> str:
    """PATH as under `.venv/bin/flotilla cluster up` with the virtual environment not activated."""
    scripts = os.path.normpath(sysconfig.get_path("scripts"))
    entries = os.environ.get("PATH", os.defpath).split(os.pathsep)
    return os.pathsep.join(entry for entry in entries if os.path.normpath(entry) != scripts)


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterHandle]:
    """A fresh cluster of the tests' own, on free ports and its own pod IPs, purged afterwards: a cluster
    that `make demo` left running (with its operator) is never touched."""
    state_dir = default_state_dir().parent / "test-cluster"
    down(state_dir, purge=True)  # whatever an interrupted run left behind, stopped by pid
    config = ClusterConfig(
        state_dir=state_dir, apiserver_port=free_port(), etcd_port=free_port(), pod_ip_base=TEST_POD_IP_BASE
    )
    config.etcd_peer_port = free_port()
    # The node agent inherits this PATH; its pods must find `flotilla` all the same.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", _path_without_scripts_dir())
        handle = ClusterHandle(up(config), started_here=True)
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
