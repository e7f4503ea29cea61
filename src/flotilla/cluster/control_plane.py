"""`flotilla cluster up | down | status`: etcd, kube-apiserver, kube-controller-manager, kube-scheduler
and the node agent as local processes bound to 127.0.0.1, with their state in one folder."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import httpx

from flotilla.cluster import node_host, node_images, pki
from flotilla.cluster.kubeclient import tls_context
from flotilla.cluster.node_layout import NodeLayout, host_ip
from flotilla.cluster.paths import default_state_dir, etcd_bin_dir, kubernetes_bin_dir
from flotilla.cluster.processes import ProcessTable, stop_all

# The default client rate (20 qps, burst 30) makes a burst of hundreds of services wait on the
# controllers' own throttling rather than on the cluster.
CLIENT_RATE = ("--kube-api-qps=100", "--kube-api-burst=200")
SERVICE_CIDR = "10.0.0.0/16"  # ClusterIPs are only allocated, never sent to; /16 fits the 500-service bench


class ClusterError(RuntimeError):
    pass


@dataclass
class ClusterConfig:
    state_dir: Path = field(default_factory=default_state_dir)
    apiserver_port: int = 6443
    etcd_port: int = 2379
    etcd_peer_port: int = 2380
    nodes: int = 2
    gpus_per_node: int = 8
    gpu_type: str = "h100"
    node_prefix: str = "gpu-node"
    simulate: bool = False
    pod_ip_base: int = 1  # pods get 127.<base>.x.y; clusters sharing a host need different bases
    # Nodes that are a real kubelet on containerd (flotilla.cluster.node_machine), each with
    # gpus_per_node fake GPUs from a device plugin; root only. 0: the node agent's nodes only.
    kubelet_nodes: int = 0

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "admin.kubeconfig"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    def node_layouts(self) -> list[NodeLayout]:
        return [NodeLayout(self.state_dir, self.pod_ip_base, i) for i in range(self.kubelet_nodes)]

    def ports(self) -> dict[str, int]:
        return {
            "etcd": self.etcd_port,
            "etcd peer": self.etcd_peer_port,
            "kube-apiserver": self.apiserver_port,
        }

    def save(self) -> None:
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        (self.state_dir / "cluster.json").write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, state_dir: Path) -> ClusterConfig | None:
        try:
            data = json.loads((state_dir / "cluster.json").read_text())
        except (OSError, ValueError):
            return None
        data["state_dir"] = Path(data["state_dir"])
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "node-agent")
# Started into the same pid table by others (the demo starts the operator), and stopped first by `down`.
ADDONS = ("operator",)


def _binary(name: str) -> Path:
    folder = etcd_bin_dir() if name == "etcd" else kubernetes_bin_dir()
    path = folder / name
    if not path.exists():
        raise ClusterError(
            f"missing binary {path}: run `flotilla cluster build` (or `flotilla cluster up` without --no-build)"
        )
    return path


def kubectl_path() -> Path:
    return _binary("kubectl")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _argv(cfg: ClusterConfig, name: str) -> list[str]:
    state, pki_dir = cfg.state_dir.resolve(), cfg.pki_dir.resolve()
    if name == "etcd":
        return [
            str(_binary("etcd")),
            "--name=flotilla",
            f"--data-dir={state / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{cfg.etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{cfg.etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{cfg.etcd_peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{cfg.etcd_peer_port}",
            f"--initial-cluster=flotilla=http://127.0.0.1:{cfg.etcd_peer_port}",
            "--listen-metrics-urls=",
            "--unsafe-no-fsync=true",  # a throwaway local cluster: speed over durability on power loss
            "--log-level=warn",
        ]
    if name == "kube-apiserver":
        return [
            str(_binary("kube-apiserver")),
            f"--etcd-servers=http://127.0.0.1:{cfg.etcd_port}",
            *(_node_flags(cfg) if cfg.kubelet_nodes else _loopback_flags()),
            f"--secure-port={cfg.apiserver_port}",
            f"--tls-cert-file={pki_dir / 'apiserver.crt'}",
            f"--tls-private-key-file={pki_dir / 'apiserver.key'}",
            f"--client-ca-file={pki_dir / 'ca.crt'}",
            "--allow-privileged=true",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki_dir / 'sa.pub'}",
            f"--service-account-signing-key-file={pki_dir / 'sa.key'}",
            "--profiling=false",
        ]
    kubeconfig = state / f"{name}.kubeconfig"
    if name == "kube-controller-manager":
        return [
            str(_binary("kube-controller-manager")),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--secure-port=0",  # nothing scrapes it locally; 0 lets several clusters share a host
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki_dir / 'sa.key'}",
            f"--root-ca-file={pki_dir / 'ca.crt'}",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
            # Fake nodes stay Ready only while the agent renews their leases; evict fast when it stops.
            "--node-monitor-grace-period=40s",
            *CLIENT_RATE,
        ]
    if name == "kube-scheduler":
        return [
            str(_binary("kube-scheduler")),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--secure-port=0",
            *CLIENT_RATE,
        ]
    if name == "node-agent":
        argv = [
            sys.executable,
            "-m",
            "flotilla.cluster.node_agent",
            f"--kubeconfig={state / 'node-agent.kubeconfig'}",
            f"--state-dir={state / 'pods'}",
            f"--nodes={cfg.nodes}",
            f"--gpus={cfg.gpus_per_node}",
            f"--gpu-type={cfg.gpu_type}",
            f"--node-prefix={cfg.node_prefix}",
            f"--pod-ip-base={cfg.pod_ip_base}",
        ]
        return [*argv, "--simulate"] if cfg.simulate else argv
    raise ValueError(name)


def _loopback_flags() -> list[str]:
    # Endpoints may not hold loopback addresses, so the `kubernetes` Service gets none.
    return [
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        "--endpoint-reconciler-type=none",
        "--authorization-mode=RBAC",
    ]


def _node_flags(cfg: ClusterConfig) -> list[str]:
    """With kubelet nodes the API server is reached from them (and their pods, through the `kubernetes`
    Service) at the host's bridge address; it reaches the kubelets for logs and exec, and webhooks at their
    pods' addresses (the host routes each node's pod range)."""
    pki_dir = cfg.pki_dir.resolve()
    return [
        "--bind-address=0.0.0.0",
        f"--advertise-address={host_ip(cfg.pod_ip_base)}",
        "--endpoint-reconciler-type=lease",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        f"--kubelet-client-certificate={pki_dir / 'admin.crt'}",
        f"--kubelet-client-key={pki_dir / 'admin.key'}",
        f"--kubelet-certificate-authority={pki_dir / 'ca.crt'}",
        "--kubelet-preferred-address-types=InternalIP",
        "--enable-aggregator-routing=true",
    ]


def _write_kubeconfigs(cfg: ClusterConfig) -> None:
    files = {
        "admin.kubeconfig": pki.ADMIN,
        "kube-controller-manager.kubeconfig": pki.CONTROLLER_MANAGER,
        "kube-scheduler.kubeconfig": pki.SCHEDULER,
        "node-agent.kubeconfig": pki.NODE_AGENT,
    }
    for filename, identity in files.items():
        (cfg.state_dir / filename).write_text(pki.kubeconfig_text(cfg.server, cfg.pki_dir, identity))


def _admin_http(cfg: ClusterConfig) -> httpx.Client:
    pki_dir = cfg.pki_dir
    context = tls_context(str(pki_dir / "ca.crt"), str(pki_dir / "admin.crt"), str(pki_dir / "admin.key"))
    return httpx.Client(base_url=cfg.server, verify=context, timeout=5.0)


def _wait_ready(cfg: ClusterConfig, table: ProcessTable, timeout: float, log) -> None:
    deadline = time.monotonic() + timeout
    last_error = ""
    with _admin_http(cfg) as client:
        while time.monotonic() < deadline:
            for name in ("etcd", "kube-apiserver"):
                if table.running(name) is None:
                    raise ClusterError(f"{name} exited during start-up; see {cfg.logs_dir / (name + '.log')}")
            try:
                response = client.get("/readyz")
                if response.status_code == 200:
                    return
                last_error = f"/readyz answered {response.status_code}"
            except httpx.HTTPError as exc:
                last_error = str(exc)
            time.sleep(0.5)
    raise ClusterError(f"kube-apiserver not ready after {timeout:.0f}s ({last_error}); see {cfg.logs_dir}")


def up(cfg: ClusterConfig, log=None, timeout: float = 120.0) -> ClusterConfig:
    """Starts whatever is not running. Idempotent: a running cluster is left as it is."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    previous = ClusterConfig.load(cfg.state_dir)
    table = ProcessTable(cfg.state_dir / "pids")
    if previous and any(table.running(n) for n in COMPONENTS):
        if previous.ports() != cfg.ports() or previous.nodes != cfg.nodes:
            log(f"a cluster is already running in {cfg.state_dir}; keeping its settings")
        cfg = previous
    for name in COMPONENTS[:-1]:
        _binary(name)
    listening = {"etcd": (cfg.etcd_port, cfg.etcd_peer_port), "kube-apiserver": (cfg.apiserver_port,)}
    for name, ports in listening.items():
        taken = [port for port in ports if table.running(name) is None and not _port_free(port)]
        if taken:
            raise ClusterError(
                f"port {taken[0]} for {name} on 127.0.0.1 is already taken; stop what holds it or pick another port"
            )
    if cfg.kubelet_nodes:
        node_host.check_host()
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    pki.ensure_pki(cfg.pki_dir, (host_ip(cfg.pod_ip_base),) if cfg.kubelet_nodes else ())
    _write_kubeconfigs(cfg)
    cfg.save()
    started = time.monotonic()
    for name in COMPONENTS:
        if name == "node-agent" and cfg.nodes == 0:
            continue
        if table.running(name):
            log(f"  {name}: already running")
            continue
        if name == "kube-controller-manager":
            _wait_ready(cfg, table, timeout, log)
        table.start(name, _argv(cfg, name), cfg.logs_dir / f"{name}.log")
        log(f"  {name}: started (log {cfg.logs_dir / (name + '.log')})")
    _wait_ready(cfg, table, timeout, log)
    log(f"cluster API ready in {time.monotonic() - started:.1f}s")
    if cfg.kubelet_nodes:
        _start_kubelet_nodes(cfg, table, log)
    return cfg


def _start_kubelet_nodes(cfg: ClusterConfig, table: ProcessTable, log) -> None:
    node_images.ensure_pause_image()
    node_images.export_image(cfg.state_dir, node_images.PAUSE_IMAGE)
    node_host.ensure_bridge(cfg.pod_ip_base)
    if cfg.kubelet_nodes > 1:
        # Pods on different nodes reach each other through the host's bridge.
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
    server = f"https://{host_ip(cfg.pod_ip_base)}:{cfg.apiserver_port}"
    for layout in cfg.node_layouts():
        spec = node_host.write_node_files(layout, cfg.pki_dir, server, cfg.gpus_per_node, cfg.gpu_type)
        node_host.start_node(table, layout, spec, log)


def down(state_dir: Path | None = None, purge: bool = False, log=None) -> list[str]:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    state_dir = state_dir or default_state_dir()
    table = ProcessTable(state_dir / "pids")
    stopped = []
    # Reverse order. The agent leaves its pods running (a restarted agent adopts them), so they are
    # stopped after it, from the pid table it keeps.
    cfg = ClusterConfig.load(state_dir)
    for name in ADDONS:
        if table.stop(name, grace_seconds=10):
            stopped.append(name)
            log(f"  {name}: stopped")
    if cfg and cfg.kubelet_nodes:
        for layout in cfg.node_layouts():
            if node_host.stop_node(table, layout):
                stopped.append(layout.name)
                log(f"  {layout.name}: stopped")
        node_host.remove_bridge(cfg.pod_ip_base)
    for name in reversed(COMPONENTS):
        if table.stop(name, grace_seconds=20 if name == "node-agent" else 10):
            stopped.append(name)
            log(f"  {name}: stopped")
    for pod in stop_all(state_dir / "pods" / "pids"):
        log(f"  pod process {pod}: stopped")
    if purge and state_dir.exists():
        shutil.rmtree(state_dir)
        log(f"  removed {state_dir}")
    return stopped


def status(state_dir: Path | None = None) -> dict:
    state_dir = state_dir or default_state_dir()
    cfg = ClusterConfig.load(state_dir)
    table = ProcessTable(state_dir / "pids")
    components = {}
    for name in COMPONENTS:
        record = table.running(name)
        components[name] = {"running": record is not None, "pid": record.pid if record else None}
    for layout in cfg.node_layouts() if cfg else []:
        record = table.running(f"node-{layout.index}")
        components[f"{layout.name} (kubelet)"] = {
            "running": record is not None,
            "pid": record.pid if record else None,
        }
    return {
        "state_dir": str(state_dir),
        "config": cfg,
        "components": components,
        "kubeconfig": str(cfg.kubeconfig) if cfg else None,
    }
