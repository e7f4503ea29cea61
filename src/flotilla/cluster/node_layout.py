"""Where a kubelet node of the local cluster lives: its addresses, interface names, cgroup and folders.

Each node is a machine of its own made from namespaces (flotilla.cluster.node_machine): a network
namespace reached from the host through a bridge per cluster, and a mount namespace in which the node's
own folders sit at the paths a kubelet and containerd expect (/var/lib/kubelet, /run/containerd, ...).
Clusters on one host differ by their `pod_ip_base`, so every name and address below is derived from it
and the node's index; nothing here touches the host."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SERVICE_IP = "10.0.0.1"  # the `kubernetes` Service's ClusterIP, first of control_plane.SERVICE_CIDR
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
PAUSE_IMAGE = "localhost/flotilla/pause:3.10"  # the pods' sandbox (pause.c from the Kubernetes module)
# The node folders, each a private bind mount of <node dir>/<name> at the path the components expect.
NODE_MOUNTS = {
    "kubelet": "/var/lib/kubelet",
    "containerd": "/var/lib/containerd",
    "run-containerd": "/run/containerd",
    "netns": "/run/netns",
    "cni-conf": "/etc/cni/net.d",
    "cni-state": "/var/lib/cni",
    "pod-logs": "/var/log/pods",
    "container-logs": "/var/log/containers",
}


def _check_base(pod_ip_base: int) -> None:
    if not 1 <= pod_ip_base <= 150:
        raise ValueError(f"pod_ip_base {pod_ip_base}: a kubelet node needs 1 <= pod_ip_base <= 150")


def bridge_name(pod_ip_base: int) -> str:
    return f"flt{pod_ip_base}"


def host_ip(pod_ip_base: int) -> str:
    """The host's address on the cluster's node bridge: where the nodes reach the API server."""
    _check_base(pod_ip_base)
    return f"10.200.{pod_ip_base}.1"


def cluster_cidr(pod_ip_base: int) -> str:
    _check_base(pod_ip_base)
    return f"10.{100 + pod_ip_base}.0.0/16"


@dataclass(frozen=True)
class NodeLayout:
    cluster_state: Path
    pod_ip_base: int
    index: int
    prefix: str = "node"

    @property
    def name(self) -> str:
        return f"{self.prefix}-{self.index}"

    @property
    def ip(self) -> str:
        _check_base(self.pod_ip_base)
        return f"10.200.{self.pod_ip_base}.{10 + self.index}"

    @property
    def pod_cidr(self) -> str:
        _check_base(self.pod_ip_base)
        return f"10.{100 + self.pod_ip_base}.{self.index}.0/24"

    @property
    def host_veth(self) -> str:
        return f"flt{self.pod_ip_base}n{self.index}"

    @property
    def cgroup_root(self) -> str:
        """The kubelet's --cgroup-root: every pod of the node lives under it, in each cgroup hierarchy."""
        return f"/flotilla-{self.pod_ip_base}-{self.index}"

    @property
    def dir(self) -> Path:
        return self.cluster_state / "nodes" / self.name

    @property
    def config_dir(self) -> Path:
        return self.dir / "config"

    @property
    def logs_dir(self) -> Path:
        return self.dir / "logs"

    @property
    def containerd_socket(self) -> str:
        return "/run/containerd/containerd.sock"  # inside the node's mount namespace
