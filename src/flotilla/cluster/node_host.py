"""The host's side of the kubelet nodes: the cluster's node bridge, each node's veth and pod route, its
configuration files and certificates, starting each node machine (flotilla.cluster.node_machine) and
loading images into its containerd. Linux only, as root (namespaces, links and routes need it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from flotilla import contract
from flotilla.cluster import node_configs, pki
from flotilla.cluster.node_layout import NODE_MOUNTS, NodeLayout, bridge_name, host_ip
from flotilla.cluster.paths import kubernetes_bin_dir
from flotilla.cluster.processes import ProcessTable

# The node's own binaries, built with the control plane (flotilla.cluster.build); containerd, ctr and the
# CNI plugins are Debian's (containerd, containernetworking-plugins).
NODE_BINARIES = ("kubelet", "kube-proxy", "fakegpu")
DEBIAN_TOOLS = {
    "containerd": "containerd",
    "ctr": "containerd",
    "unshare": "util-linux",
    "nsenter": "util-linux",
}


class NodeError(RuntimeError):
    pass


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NodeError(f"ip {' '.join(argv)} failed: {done.stderr.strip()}")
    return done


def check_host() -> None:
    """NodeError naming what is missing: root, Debian's packages or the node binaries."""
    if os.geteuid() != 0:
        raise NodeError("kubelet nodes need root (namespaces, mounts, links and cgroups)")
    missing = sorted({pkg for tool, pkg in DEBIAN_TOOLS.items() if shutil.which(tool) is None})
    if not Path(node_configs.CNI_BIN_DIR, "bridge").exists():
        missing.append("containernetworking-plugins")
    if missing:
        raise NodeError(
            f"kubelet nodes need Debian's {', '.join(missing)}: apt-get install -y {' '.join(missing)}"
        )
    absent = [name for name in NODE_BINARIES if not (kubernetes_bin_dir() / name).exists()]
    if absent:
        raise NodeError(
            f"missing {', '.join(absent)} in {kubernetes_bin_dir()}: run `flotilla cluster build`"
        )


def ensure_bridge(pod_ip_base: int) -> None:
    name = bridge_name(pod_ip_base)
    if _ip("link", "show", name, check=False).returncode != 0:
        _ip("link", "add", name, "type", "bridge")
    _ip("addr", "replace", f"{host_ip(pod_ip_base)}/24", "dev", name)
    _ip("link", "set", name, "up")


def remove_bridge(pod_ip_base: int) -> None:
    _ip("link", "del", bridge_name(pod_ip_base), check=False)


def write_node_files(layout: NodeLayout, pki_dir: Path, server: str, gpus: int, gpu_type: str) -> Path:
    """The node's configuration and its machine's spec; returns the spec's path."""
    pki.ensure_node_pki(pki_dir, layout.name, layout.ip)
    kubelet_identity, proxy_identity = pki.node_identities(layout.name)
    config = layout.config_dir
    config.mkdir(parents=True, exist_ok=True)
    files = {
        "containerd.toml": node_configs.containerd_toml(layout),
        "kubelet.yaml": node_configs.kubelet_config(layout, pki_dir),
        "kubelet.kubeconfig": pki.kubeconfig_text(server, pki_dir, kubelet_identity),
        "kube-proxy.kubeconfig": pki.kubeconfig_text(server, pki_dir, proxy_identity),
    }
    files["kube-proxy.yaml"] = node_configs.kube_proxy_config(layout, config / "kube-proxy.kubeconfig")
    for name, text in files.items():
        (config / name).write_text(text)
    cni = layout.dir / "cni-conf"
    cni.mkdir(parents=True, exist_ok=True)
    (cni / "10-flotilla.conflist").write_text(node_configs.cni_conflist(layout))
    bins = kubernetes_bin_dir()
    spec = {
        "name": layout.name,
        "ip": layout.ip,
        "gateway": host_ip(layout.pod_ip_base),
        "cgroup_root": layout.cgroup_root,
        "mounts": {target: str(layout.dir / name) for name, target in NODE_MOUNTS.items()},
        "logs_dir": str(layout.logs_dir),
        "containerd": ["containerd", "--config", str(config / "containerd.toml")],
        "images": [str(p) for p in sorted(images_dir(layout.cluster_state).glob(f"*{ARCHIVE_SUFFIX}"))],
        "ctr": ctr(layout),
        "daemons": {
            "kubelet": [
                str(bins / "kubelet"),
                f"--config={config / 'kubelet.yaml'}",
                f"--kubeconfig={config / 'kubelet.kubeconfig'}",
                f"--hostname-override={layout.name}",
                f"--node-ip={layout.ip}",
                f"--node-labels={contract.GPU_TYPE_LABEL}={gpu_type}",
                "--v=1",
            ],
            "kube-proxy": [str(bins / "kube-proxy"), f"--config={config / 'kube-proxy.yaml'}", "--v=1"],
            "fakegpu": [
                str(bins / "fakegpu"),
                f"--count={gpus}",
                f"--resource={contract.GPU_RESOURCE}",
                f"--prefix=GPU-{layout.name}",
            ],
        },
    }
    path = layout.dir / "node.json"
    path.write_text(json.dumps(spec, indent=2))
    return path


ARCHIVE_SUFFIX = ".image"  # a docker archive of one image (`buildah push docker-archive:`)


def images_dir(cluster_state: Path) -> Path:
    """Image archives every node imports when it starts (and `load_image` into running nodes)."""
    return cluster_state / "images"


def _wait_own_netns(pid: int, timeout: float = 10.0) -> None:
    own = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != own:
                return
        except OSError as exc:
            raise NodeError(f"the node machine (pid {pid}) exited at start") from exc
        time.sleep(0.05)
    raise NodeError(f"the node machine (pid {pid}) never entered its network namespace")


def start_node(table: ProcessTable, layout: NodeLayout, spec_path: Path, log) -> None:
    name = f"node-{layout.index}"
    if table.running(name):
        log(f"  {layout.name}: already running")
        return
    argv = [
        "unshare",
        "--mount",
        "--net",
        "--uts",
        "--propagation",
        "slave",
        sys.executable,
        "-m",
        "flotilla.cluster.node_machine",
        str(spec_path),
    ]
    proc = table.start(name, argv, layout.logs_dir / "machine.log")
    _wait_own_netns(proc.pid)
    _ip("link", "del", layout.host_veth, check=False)  # a node that died left its half behind
    _ip("link", "add", layout.host_veth, "type", "veth", "peer", "name", "eth0", "netns", str(proc.pid))
    _ip("link", "set", layout.host_veth, "master", bridge_name(layout.pod_ip_base), "up")
    _ip("route", "replace", layout.pod_cidr, "via", layout.ip)
    log(f"  {layout.name}: started at {layout.ip}, pods {layout.pod_cidr} (logs {layout.logs_dir})")


def node_pid(table: ProcessTable, layout: NodeLayout) -> int:
    record = table.running(f"node-{layout.index}")
    if record is None:
        raise NodeError(f"{layout.name} is not running")
    return record.pid


def in_node(table: ProcessTable, layout: NodeLayout, *argv: str) -> list[str]:
    """argv made to run inside the node (its mount, network and UTS namespaces)."""
    return ["nsenter", f"--target={node_pid(table, layout)}", "--mount", "--net", "--uts", *argv]


def ctr(layout: NodeLayout) -> list[str]:
    """containerd's own client, on the node's socket, in the namespace the kubelet's images live in."""
    return ["ctr", "--address", layout.containerd_socket, "--namespace", "k8s.io"]


def node_exec(table: ProcessTable, layout: NodeLayout, *argv: str, timeout: float = 600) -> str:
    """Runs argv inside the node; its output, or NodeError."""
    command = in_node(table, layout, *argv)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise NodeError(
            f"{' '.join(argv)} on {layout.name} failed ({done.returncode}): {done.stderr.strip()}"
        )
    return done.stdout


def daemon_pid(layout: NodeLayout, name: str) -> int | None:
    """The pid of a node's daemon (containerd, kubelet, kube-proxy, fakegpu) as its machine last started it."""
    try:
        return json.loads((layout.dir / "daemons.json").read_text()).get(name)
    except (OSError, ValueError):
        return None


def kill_container(table: ProcessTable, layout: NodeLayout, container_id: str) -> None:
    """SIGKILL a container's process through containerd, as the kernel's OOM killer or a crash would end it."""
    node_exec(table, layout, *ctr(layout), "tasks", "kill", "--signal", "SIGKILL", container_id)


def stop_node(table: ProcessTable, layout: NodeLayout) -> bool:
    stopped = table.stop(f"node-{layout.index}", grace_seconds=40)
    _ip("route", "del", layout.pod_cidr, check=False)
    _ip("link", "del", layout.host_veth, check=False)
    return stopped
