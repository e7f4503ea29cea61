"""`flotilla operator bench`: the scale benchmark. Prints figures; asserts nothing.

Starts its own simulated local cluster (the node agent marks pods Ready without running them), runs the
operator as a subprocess, creates N InferenceServices at once and reports:
- seconds until all are Ready (target: 500 services on 200 nodes under 120 s);
- the operator's peak RSS (VmHWM; target under 300 MB);
- the operator's own API calls per reconcile and per service (from its /metrics).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--services", type=int, default=500)
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=600, help="give up after this many seconds")
    parser.add_argument("--apiserver-port", type=int, default=16443)
    parser.add_argument("--etcd-port", type=int, default=12379)
    parser.add_argument("--pod-ip-base", type=int, default=60)
    parser.add_argument("--keep", action="store_true", help="leave the bench cluster running")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _manifest(count: int) -> str:
    docs = [
        {
            "apiVersion": "flotilla.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": f"svc-{i:04d}", "namespace": NAMESPACE},
            "spec": {
                "model": {"uri": "file:///models/bench"},
                "resources": {"gpus": 1, "gpuType": "h100"},
                "replicas": 1,
            },
        }
        for i in range(count)
    ]
    return yaml.safe_dump_all(docs)


def _metric_sum(text: str, name: str) -> float:
    pattern = re.compile(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(args: argparse.Namespace) -> int:
    from flotilla.cluster.control_plane import ClusterConfig, down, kubectl_path, up

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

    def kubectl(*kargs: str, input: str | None = None) -> str:
        result = subprocess.run(
            [str(kubectl_path()), f"--kubeconfig={cfg.kubeconfig}", *kargs],
            capture_output=True,
            text=True,
            input=input,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(kargs[:3])}: {result.stderr.strip()[:2000]}")
        return result.stdout

    operator = None
    try:
        kubectl("apply", "--server-side", "-f", str(REPO_ROOT / "crds"))
        kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(REPO_ROOT / "crds"))
        kubectl("apply", "-f", str(REPO_ROOT / "deploy" / "operator-rbac.yaml"))
        kubectl("create", "namespace", NAMESPACE)
        port = _free_port()
        log_path = state_dir / "operator.log"
        operator = subprocess.Popen(
            [sys.executable, "-m", "flotilla.cli", "operator", "run", "--kubeconfig", str(cfg.kubeconfig),
             "--metrics-port", str(port), "--no-model-path-check"],
            stdout=log_path.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONSAFEPATH": "1"},
            cwd=state_dir,
        )  # fmt: skip
        _wait_healthy(port, operator)

        print(f"bench: creating {args.services} InferenceServices", flush=True)
        start = time.monotonic()
        kubectl("apply", "--server-side", "-f", "-", input=_manifest(args.services))
        ready, elapsed = 0, 0.0
        while elapsed < args.timeout:
            out = kubectl(
                "get", "fisvc", "-n", NAMESPACE, "-o", 'jsonpath={.items[*].status.conditions[?(@.type=="Ready")].status}'
            )  # fmt: skip
            ready = out.split().count("True")
            elapsed = time.monotonic() - start
            if ready >= args.services:
                break
            time.sleep(2)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        calls = _metric_sum(metrics, "flotilla_operator_api_calls_total")
        reconciles = _metric_sum(metrics, "flotilla_reconciles_total")
        errors = _metric_sum(metrics, "flotilla_reconcile_errors_total")
        print()
        print(f"services Ready        {ready}/{args.services} on {args.nodes} simulated nodes")
        print(f"time until all Ready  {elapsed:.1f} s   (target < 120 s)" if ready >= args.services else
              f"time until all Ready  not reached in {args.timeout:.0f} s")  # fmt: skip
        print(f"operator peak RSS     {_peak_rss_mb(operator.pid):.0f} MB   (target < 300 MB)")
        print(f"reconciles            {reconciles:.0f} ({errors:.0f} raised)")
        print(f"operator API calls    {calls:.0f}: {calls / max(reconciles, 1):.2f} per reconcile, "
              f"{calls / max(args.services, 1):.1f} per service")  # fmt: skip
        print("  (the operator's own calls: applies and status patches; kopf's watches and its annotation")
        print("   patches are not counted)")
        print(f"operator log          {log_path}")
        return 0 if ready >= args.services else 1
    finally:
        if operator is not None and operator.poll() is None:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                operator.kill()
        if not args.keep:
            down(state_dir, purge=False)


def _wait_healthy(port: int, proc: subprocess.Popen) -> None:
    for _ in range(120):
        if proc.poll() is not None:
            raise RuntimeError(f"the operator exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as rsp:
                if rsp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the operator did not become healthy")
