"""`flotilla cluster ...`: build the control-plane binaries and run the local cluster."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def _err(message: str) -> int:
    print(f"flotilla cluster: {message}", file=sys.stderr)
    return 1


def cmd_build(args) -> int:
    from flotilla.cluster.build import BuildError, build

    try:
        figures = build(force=args.force)
    except BuildError as exc:
        return _err(str(exc))
    if args.json:
        print(json.dumps(figures))
    return 0


def cmd_gomod(_args) -> int:
    from flotilla.cluster.gomod import generate

    generate()
    return 0


def _config(args):
    from flotilla.cluster.control_plane import ClusterConfig

    cfg = ClusterConfig(
        nodes=args.nodes,
        gpus_per_node=args.gpus,
        gpu_type=args.gpu_type,
        apiserver_port=args.apiserver_port,
        etcd_port=args.etcd_port,
        etcd_peer_port=args.etcd_port + 1,
        simulate=args.simulate,
        pod_ip_base=args.pod_ip_base,
        kubelet_nodes=args.kubelet_nodes,
    )
    if args.state_dir:
        cfg.state_dir = args.state_dir
    return cfg


def cmd_up(args) -> int:
    from flotilla.cluster.build import BuildError, build
    from flotilla.cluster.control_plane import ClusterError, up
    from flotilla.cluster.node_host import NodeError

    low_nodes = 0 if args.kubelet_nodes else 1
    checks = (
        ("--nodes", args.nodes, low_nodes),
        ("--gpus", args.gpus, 0),
        ("--kubelet-nodes", args.kubelet_nodes, 0),
    )
    for name, value, low in checks:
        if value < low:
            return _err(f"{name} must be at least {low}, got {value}")
    try:
        if not args.no_build:
            build()
        cfg = up(_config(args))
        if args.wait_nodes:
            # A kubelet node imports its images and registers in a minute or two on two cores.
            _wait_nodes(cfg, cfg.nodes + cfg.kubelet_nodes, timeout=60 + 120 * cfg.kubelet_nodes)
    except (ClusterError, BuildError, NodeError) as exc:
        return _err(str(exc))
    _print_status(cfg.state_dir)
    return 0


def _kubectl(cfg, *argv: str) -> subprocess.CompletedProcess:
    from flotilla.cluster.control_plane import kubectl_path

    return subprocess.run(
        [str(kubectl_path()), f"--kubeconfig={cfg.kubeconfig}", *argv], capture_output=True, text=True
    )


def _wait_nodes(cfg, count: int, timeout: float) -> None:
    import time

    from flotilla.cluster.control_plane import ClusterError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = _kubectl(
            cfg,
            "get",
            "nodes",
            "-o",
            'jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\\n"}{end}',
        )
        if result.returncode == 0 and result.stdout.split().count("True") >= count:
            return
        time.sleep(0.5)
    raise ClusterError(
        f"nodes not Ready after {timeout:.0f}s; see {cfg.logs_dir / 'node-agent.log'} and the kubelet nodes' "
        f"logs in {cfg.state_dir / 'nodes'}"
    )


def cmd_down(args) -> int:
    from flotilla.cluster.control_plane import down
    from flotilla.cluster.paths import default_state_dir

    stopped = down(args.state_dir or default_state_dir(), purge=args.purge)
    if not stopped and not args.purge:
        print("no cluster processes were running")
    return 0


# `systemctl status` codes, so a script can tell a working cluster from one that needs `up`.
STATUS_RUNNING = 0
STATUS_NOT_RUNNING = 3
STATUS_DESCRIPTION = (
    "Print the components, nodes and the KUBECONFIG line. Exits 0 when every component is running and 3 "
    "otherwise: no cluster, all stopped, or only some running (a partial cluster cannot run pods; "
    "`flotilla cluster up` starts just the missing components)."
)


def status_exit_code(components: dict[str, dict]) -> int:
    """A partial cluster counts as not running, like a systemd unit that is not fully active."""
    if components and all(component["running"] for component in components.values()):
        return STATUS_RUNNING
    return STATUS_NOT_RUNNING


def _print_status(state_dir: Path) -> int:
    from flotilla.cluster.control_plane import ClusterConfig, status

    info = status(state_dir)
    for name, component in info["components"].items():
        state = f"running (pid {component['pid']})" if component["running"] else "stopped"
        print(f"{name:<24} {state}")
    cfg = ClusterConfig.load(state_dir)
    if cfg is None:
        print(f"no cluster in {state_dir}; start one with `flotilla cluster up`")
        return STATUS_NOT_RUNNING
    if info["components"]["kube-apiserver"]["running"]:
        result = _kubectl(
            cfg,
            "get",
            "nodes",
            "-L",
            "flotilla.dev/gpu-type",
            "-o",
            "custom-columns=NAME:.metadata.name,READY:.status.conditions[?(@.type=='Ready')].status,"
            "GPUS:.status.capacity.nvidia\\.com/gpu,GPU-TYPE:.metadata.labels.flotilla\\.dev/gpu-type",
        )
        print()
        print(result.stdout.rstrip() or result.stderr.rstrip())
    print()
    print(f"export KUBECONFIG={cfg.kubeconfig}")
    from flotilla.cluster.paths import default_state_dir

    where = "" if state_dir == default_state_dir() else f" --state-dir {state_dir}"
    print(f"stop it with: flotilla cluster down{where}   (add --purge to wipe its state)")
    return status_exit_code(info["components"])


def cmd_load_image(args) -> int:
    from flotilla.cluster.control_plane import ClusterConfig
    from flotilla.cluster.node_host import NodeError
    from flotilla.cluster.node_images import ImageError, load_image
    from flotilla.cluster.paths import default_state_dir
    from flotilla.cluster.processes import ProcessTable

    state_dir = args.state_dir or default_state_dir()
    cfg = ClusterConfig.load(state_dir)
    if cfg is None or not cfg.kubelet_nodes:
        return _err(f"no cluster with kubelet nodes in {state_dir} (flotilla cluster up --kubelet-nodes N)")
    table = ProcessTable(state_dir / "pids")
    try:
        for image in args.image:
            for layout in cfg.node_layouts():
                print(f"loading {image} into {layout.name} ...", flush=True)
                seconds = load_image(table, layout, image)
                print(f"  {image} in {layout.name}'s containerd ({seconds:.0f}s)", flush=True)
    except (ImageError, NodeError) as exc:
        return _err(str(exc))
    return 0


def cmd_status(args) -> int:
    from flotilla.cluster.paths import default_state_dir

    return _print_status(args.state_dir or default_state_dir())


def add_commands(commands: argparse._SubParsersAction) -> None:
    build = commands.add_parser("build", help="build etcd and the Kubernetes binaries (cached per version)")
    build.add_argument("--force", action="store_true", help="rebuild even what is cached")
    build.add_argument("--json", action="store_true", help="print build time and peak memory as JSON")
    build.set_defaults(func=cmd_build)

    gomod = commands.add_parser("gomod", help="regenerate the Go wrapper modules from the pinned releases")
    gomod.set_defaults(func=cmd_gomod)

    up = commands.add_parser("up", help="start the local cluster (idempotent)")
    up.add_argument("--state-dir", type=Path, help="where state, logs and the kubeconfig live")
    up.add_argument("--nodes", type=int, default=2, help="fake GPU nodes to register (default 2)")
    up.add_argument("--gpus", type=int, default=8, help="nvidia.com/gpu per node (default 8)")
    up.add_argument("--gpu-type", default="h100", help="value of the flotilla.dev/gpu-type label")
    up.add_argument(
        "--kubelet-nodes",
        type=int,
        default=0,
        help="real nodes: a kubelet on containerd each, with --gpus fake GPUs from a device plugin "
        "(root; Debian's containerd and containernetworking-plugins). Default 0",
    )
    up.add_argument("--apiserver-port", type=int, default=6443)
    up.add_argument(
        "--etcd-port", type=int, default=2379, help="etcd client port; the peer port is the next one"
    )
    up.add_argument(
        "--pod-ip-base",
        type=int,
        default=1,
        help="pods get 127.BASE.x.y; give each cluster on a host its own",
    )
    up.add_argument(
        "--simulate", action="store_true", help="mark pods Ready without running them (scale tests)"
    )
    up.add_argument("--no-build", action="store_true", help="fail instead of building missing binaries")
    up.add_argument(
        "--no-wait-nodes", dest="wait_nodes", action="store_false", help="do not wait for Ready nodes"
    )
    up.set_defaults(func=cmd_up)

    down = commands.add_parser("down", help="stop exactly the processes `up` started")
    down.add_argument("--state-dir", type=Path)
    down.add_argument("--purge", action="store_true", help="also delete the cluster's state folder")
    down.set_defaults(func=cmd_down)

    load = commands.add_parser(
        "load-image",
        help="stream images from buildah's storage into every kubelet node's containerd (no registry)",
    )
    load.add_argument("image", nargs="+", help="e.g. ghcr.io/flotilla-dev/flotilla-engine:0.1.0")
    load.add_argument("--state-dir", type=Path)
    load.set_defaults(func=cmd_load_image)

    status = commands.add_parser(
        "status",
        help="components, nodes and the KUBECONFIG line; exits 0 only when all run, else 3",
        description=STATUS_DESCRIPTION,
    )
    status.add_argument("--state-dir", type=Path)
    status.set_defaults(func=cmd_status)
