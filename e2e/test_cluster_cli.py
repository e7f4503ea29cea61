"""Wrong input to `flotilla cluster` gets a clear message and starts nothing."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from flotilla.cluster.handle import ClusterHandle
from flotilla.cluster.processes import ProcessTable


def _flotilla(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flotilla.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_unknown_flag_is_named():
    result = _flotilla("cluster", "up", "--gpu-count", "4")
    assert result.returncode == 2
    assert "unrecognized arguments: --gpu-count" in result.stderr


def _free_pair() -> int:
    """A port that is free with the one after it (etcd's peer port): only the held port may be taken."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two adjacent free ports on 127.0.0.1")


def test_port_already_taken_is_named_and_nothing_starts(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        free_port = _free_pair()  # etcd's client port; its peer port is the next one
        result = _flotilla(
            "cluster",
            "up",
            "--no-build",
            "--state-dir",
            str(tmp_path / "state"),
            "--apiserver-port",
            str(port),
            "--etcd-port",
            str(free_port),
        )
    assert result.returncode == 1
    assert f"port {port} for kube-apiserver on 127.0.0.1 is already taken" in result.stderr
    assert ProcessTable(tmp_path / "state" / "pids").names() == []


def test_missing_binary_with_build_switched_off(tmp_path):
    import os

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "empty-cache"))
    result = _flotilla("cluster", "up", "--no-build", "--state-dir", str(tmp_path / "state"), env=env)
    assert result.returncode == 1
    assert "missing binary" in result.stderr and "etcd" in result.stderr
    assert "flotilla cluster build" in result.stderr


def test_bad_node_count_is_refused(tmp_path):
    result = _flotilla("cluster", "up", "--no-build", "--nodes", "0", "--state-dir", str(tmp_path / "s"))
    assert result.returncode == 1
    assert "--nodes must be at least 1, got 0" in result.stderr


@pytest.mark.cluster
def test_status_of_a_running_cluster_exits_0(cluster: ClusterHandle):
    result = _flotilla("cluster", "status", "--state-dir", str(cluster.config.state_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stopped" not in result.stdout
    assert f"export KUBECONFIG={cluster.kubeconfig}" in result.stdout
