"""--simulate: pods become Running and Ready without any process, for scale tests."""

from __future__ import annotations

import socket
import textwrap

import pytest

from flotilla.cluster.control_plane import ClusterConfig, down, up
from flotilla.cluster.handle import ClusterHandle, wait_for

pytestmark = pytest.mark.cluster


def _free_port_pair() -> int:
    """A port p with p+1 also free (etcd takes both)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free port pair")


def test_simulated_pods_are_ready_without_processes(tmp_path, cluster: ClusterHandle):
    # `cluster` only guarantees the binaries exist; this test runs a second, simulated cluster of its own.
    cfg = ClusterConfig(
        state_dir=tmp_path / "sim",
        apiserver_port=_free_port_pair(),
        etcd_port=_free_port_pair(),
        nodes=3,
        simulate=True,
        node_prefix="sim-node",
        pod_ip_base=200,
    )
    cfg.etcd_peer_port = cfg.etcd_port + 1
    handle = ClusterHandle(up(cfg), started_here=True)
    try:
        wait_for(
            lambda: handle.kubectl("get", "nodes", "-o", "name").stdout.count("node/") == 3, 60, "3 nodes"
        )
        handle.apply(
            textwrap.dedent("""
            apiVersion: apps/v1
            kind: Deployment
            metadata: {name: phantom, namespace: default}
            spec:
              replicas: 6
              selector: {matchLabels: {app: phantom}}
              template:
                metadata: {labels: {app: phantom}}
                spec:
                  containers:
                  - {name: main, image: none, command: ["/does/not/exist"], resources: {limits: {nvidia.com/gpu: 2}}}
            """)
        )
        deployment = wait_for(
            lambda: (
                (d := handle.get_json("deployment", "phantom", "-n", "default"))["status"].get(
                    "readyReplicas"
                )
                == 6
                and d
            ),
            90,
            "6 ready simulated replicas",
        )
        assert deployment["status"]["readyReplicas"] == 6
        pods = handle.get_json("pods", "-n", "default", "-l", "app=phantom")["items"]
        assert {p["status"]["podIP"].split(".")[1] for p in pods} == {"200"}
        assert len({p["status"]["podIP"] for p in pods}) == 6
        assert len({p["spec"]["nodeName"] for p in pods}) >= 2  # 6 pods x 2 GPUs cannot fit on one 8-GPU node
        assert not (cfg.state_dir / "pods" / "logs").exists()  # nothing was ever started
    finally:
        down(cfg.state_dir, purge=True)
