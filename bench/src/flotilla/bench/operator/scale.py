"""`flotilla operator bench`: the scale benchmark. Prints figures; asserts nothing.

Starts its own simulated local cluster (the node agent marks pods Ready without running them), runs the
operator as a subprocess, creates N InferenceServices at once and reports:
- seconds until all are Ready (target: 500 services on 200 nodes under 120 s);
- the operator's peak RSS (VmHWM; target under 300 MB);
- the operator's own API calls per reconcile and per service (from its /metrics).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from flotilla import manifest_yaml
from flotilla.contract import METRICS_PATH, OPERATOR_API_CALLS, RECONCILE_ERRORS, RECONCILES, counter_total

NAMESPACE = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--services", type=int, default=500)
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=600, help="give up after this many seconds")
    parser.add_argument("--apiserver-port", type=int, default=16443)
    parser.add_argument("--etcd-port", type=int, default=12379)
    parser.add_argument("--pod-ip-base", type=int, default=60)
    parser.add_argument("--keep", action="store_true", help="leave the bench cluster running")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")


# The services' model folder (never read: the cluster is simulated), allowed as the operator's host-path root.
MODEL_ROOT = "/models"


def _manifest(count: int) -> str:
    docs = [
        {
            "apiVersion": "flotilla.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": f"svc-{i:04d}", "namespace": NAMESPACE},
            "spec": {
                "model": {"uri": f"file://{MODEL_ROOT}/bench"},
                "resources": {"gpus": 1, "gpuType": "h100"},
                "replicas": 1,
            },
        }
        for i in range(count)
    ]
    return manifest_yaml.dump_all(docs)


def _metric_sum(text: str, name: str) -> float:
    pattern = re.compile(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(args: argparse.Namespace) -> int:
    from flotilla.cluster.control_plane import ClusterConfig, down, up
    from flotilla.cluster.handle import ClusterHandle
    from flotilla.operator.cmd.local import OperatorProcess, install_manifests, service_account_kubeconfig

    # SIGTERM unwinds like Ctrl-C, so the finally below stops the operator and the bench cluster.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    state_dir = Path(tempfile.mkdtemp(prefix="flotilla-bench-"))
    cfg = ClusterConfig(
        state_dir=state_dir,
        apiserver_port=args.apiserver_port,
        etcd_port=args.etcd_port,
        etcd_peer_port=args.etcd_port + 1,
        nodes=args.nodes,
        simulate=True,
        pod_ip_base=args.pod_ip_base,
    )
    print(f"bench: starting a simulated cluster with {args.nodes} nodes in {state_dir}", flush=True)
    up(cfg, timeout=300)

    cluster = ClusterHandle(cfg, started_here=True)

    def kubectl(*kargs: str, input: str | None = None) -> str:
        return cluster.kubectl(*kargs, input=input, timeout=300).stdout

    operator = None
    try:
        install_manifests(cluster)
        kubectl("create", "namespace", NAMESPACE)
        operator = OperatorProcess(
            service_account_kubeconfig(cluster, state_dir / "operator.kubeconfig"),
            state_dir / "operator.log",
            ("--no-model-path-check",),
            host_path_roots=(MODEL_ROOT,),
        )
        operator.start()
        log_path = operator.log_path

        print(f"bench: creating {args.services} InferenceServices", flush=True)
        start = time.monotonic()
        kubectl("apply", "--server-side", "-f", "-", input=_manifest(args.services))
        applied = time.monotonic() - start  # kubectl sends the services one by one
        print(f"bench: kubectl apply returned after {applied:.0f} s", flush=True)
        ready, elapsed = 0, 0.0
        while elapsed < args.timeout:
            out = kubectl(
                "get", "fisvc", "-n", NAMESPACE, "-o", 'jsonpath={.items[*].status.conditions[?(@.type=="Ready")].status}'
            )  # fmt: skip
            ready = out.split().count("True")
            elapsed = time.monotonic() - start
            if ready >= args.services:
                break
            print(f"bench: {ready}/{args.services} Ready after {elapsed:.0f} s", flush=True)
            time.sleep(2)
        metrics = operator.get(METRICS_PATH)[1]
        calls = _metric_sum(metrics, counter_total(OPERATOR_API_CALLS))
        reconciles = _metric_sum(metrics, counter_total(RECONCILES))
        errors = _metric_sum(metrics, counter_total(RECONCILE_ERRORS))
        print()
        print(f"services Ready        {ready}/{args.services} on {args.nodes} simulated nodes")
        print(f"time until all Ready  {elapsed:.1f} s   (target < 120 s)" if ready >= args.services else
              f"time until all Ready  not reached in {args.timeout:.0f} s")  # fmt: skip
        print(f"  of which kubectl apply {applied:.1f} s (one server-side apply per service)")
        print(f"operator peak RSS     {_peak_rss_mb(operator.proc.pid):.0f} MB   (target < 300 MB)")
        print(f"reconciles            {reconciles:.0f} ({errors:.0f} raised)")
        print(f"operator API calls    {calls:.0f}: {calls / max(reconciles, 1):.2f} per reconcile, "
              f"{calls / max(args.services, 1):.1f} per service")  # fmt: skip
        print("  (the operator's own calls: applies and status patches; kopf's watches and its annotation")
        print("   patches are not counted)")
        print(f"operator log          {log_path}")
        if args.json:
            figures = {
                "services": args.services,
                "nodes": args.nodes,
                "ready": ready,
                "seconds_until_all_ready": elapsed if ready >= args.services else None,
                "seconds_in_kubectl_apply": applied,
                "operator_peak_rss_mb": _peak_rss_mb(operator.proc.pid),
                "reconciles": reconciles,
                "reconcile_errors": errors,
                "api_calls": calls,
                "api_calls_per_reconcile": calls / max(reconciles, 1),
            }
            args.json.write_text(json.dumps(figures, indent=2) + "\n")
        return 0 if ready >= args.services else 1
    finally:
        if operator is not None:
            operator.stop()
        if not args.keep:
            down(state_dir, purge=False)
