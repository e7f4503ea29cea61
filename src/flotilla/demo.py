"""`flotilla demo`: the platform story on the running local cluster, end to end.

The operator (under its own ServiceAccount) is started in the cluster's pid table, so it keeps running
after the demo and `flotilla cluster down` stops it. A Tenant owns the `demo` namespace with a GPU quota;
an InferenceService there runs the real engine on a random-weight tiny model; the demo waits for
Ready=True and asks it for one completion through the official `openai` client.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

NAMESPACE = "demo"
TENANT = "demo-team"
SERVICE = "tiny-chat"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir", type=Path, help="the cluster's state folder (default: the local cluster)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for Ready (default 600)")
    parser.set_defaults(func=run)


def _manifests(model_dir: Path) -> str:
    from flotilla.operator.cmd.local import inference_service

    tenant = {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": TENANT},
        "spec": {
            "namespaces": [NAMESPACE],
            "gpuQuota": {"h100": 4},
            "pricePerGPUHour": {"h100": 2.5},
        },
    }
    service = inference_service(
        SERVICE,
        model_dir,
        NAMESPACE,
        served_name="tiny-llama",
        engine={"kvCacheMemory": "64Mi", "maxNumSeqs": 8},
    )
    return yaml.safe_dump_all([tenant, service])


def _step(message: str) -> None:
    print(f"== {message}", flush=True)


def _model(state_dir: Path) -> Path:
    from flotilla.operator.cmd.local import tiny_model

    model_dir = state_dir / "models" / "tiny-llama"
    print(f"   {'reusing' if (model_dir / 'config.json').exists() else 'writing'} {model_dir}")
    return tiny_model(model_dir)


def _start_operator(cluster, state_dir: Path):
    from flotilla.cluster.processes import ProcessTable
    from flotilla.operator.cmd.local import OperatorProcess, install_manifests, service_account_kubeconfig

    install_manifests(cluster)
    table = ProcessTable(state_dir / "pids")
    table.stop("operator")  # a previous demo's operator; its pid record says which process it is
    workdir = state_dir / "operator"
    workdir.mkdir(parents=True, exist_ok=True)
    operator = OperatorProcess(
        service_account_kubeconfig(cluster, workdir / "operator.kubeconfig"), workdir / "operator.log"
    )
    operator.start(table=table)
    print(f"   pid {operator.proc.pid}, metrics {operator.url}/metrics, log {operator.log_path}")
    return operator


def _wait_ready(cluster, timeout: float) -> dict:
    """Prints each change of the service's conditions, so a slow model load is visible as progress."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        result = cluster.kubectl("get", "fisvc", SERVICE, "-n", NAMESPACE, "-o", "json", check=False)
        if result.returncode == 0:
            obj = yaml.safe_load(result.stdout)
            status = obj.get("status") or {}
            conditions = {c["type"]: c for c in status.get("conditions") or []}
            summary = ", ".join(f"{t}={c['status']}" for t, c in sorted(conditions.items()))
            line = f"   {summary or 'no status yet'}; {status.get('message', '')}".rstrip("; ")
            if line != last:
                print(line, flush=True)
                last = line
            if conditions.get("Ready", {}).get("status") == "True" and status.get("endpoints"):
                return status
        time.sleep(2)
    raise SystemExit(f"demo: {SERVICE} was not Ready after {timeout:.0f}s; see `kubectl describe fisvc`")


def _tenant_status(cluster) -> dict:
    result = cluster.kubectl("get", "tenant", TENANT, "-o", "json", check=False)
    return (yaml.safe_load(result.stdout) or {}).get("status") or {} if result.returncode == 0 else {}


def _metered_output(status: dict) -> int:
    return (status.get("tokens") or {}).get("output", 0)


def _wait_metered(cluster, output_tokens: int, timeout: float) -> dict | None:
    """The Tenant's status once metering has counted at least `output_tokens` generated tokens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = _tenant_status(cluster)
        if _metered_output(status) >= output_tokens:
            return status
        time.sleep(2)
    return None


def run(args: argparse.Namespace) -> int:
    from openai import OpenAI

    from flotilla.cluster.control_plane import ClusterConfig
    from flotilla.cluster.handle import ClusterHandle
    from flotilla.cluster.paths import default_state_dir

    state_dir = args.state_dir or default_state_dir()
    config = ClusterConfig.load(state_dir)
    if config is None:
        print(f"demo: no cluster in {state_dir}; start one with `flotilla cluster up`", file=sys.stderr)
        return 1
    cluster = ClusterHandle(config, started_here=False)

    _step("the operator: CRDs, least-privilege RBAC, `flotilla operator run` as its ServiceAccount")
    _start_operator(cluster, state_dir)

    _step("a random-weight tiny model (flotilla model init --preset tiny-llama)")
    model_dir = _model(state_dir)

    _step(f"Tenant {TENANT} owning namespace {NAMESPACE}, and InferenceService {SERVICE}")
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    print(cluster.apply(_manifests(model_dir)).stdout.rstrip())

    _step(f"waiting for {SERVICE} to be Ready (the engine loads the model in its pod)")
    status = _wait_ready(cluster, args.timeout)
    endpoint = status["endpoints"][0]
    print(cluster.kubectl("get", "fisvc", "-n", NAMESPACE).stdout.rstrip())

    _step(f"one completion through the openai client at {endpoint}")
    metered_before = _metered_output(_tenant_status(cluster))  # an earlier demo's completions
    client = OpenAI(base_url=endpoint, api_key="unused", timeout=120)
    answer = client.completions.create(
        model="tiny-llama", prompt="The fleet sails", max_tokens=12, extra_body={"ignore_eos": True}
    )
    print(f"   text: {answer.choices[0].text!r}")
    print(
        f"   usage: {answer.usage.prompt_tokens} prompt + {answer.usage.completion_tokens} completion tokens"
    )
    print("   (the weights are random, so the text is noise; the path through the fleet is real)")

    _step(f"metering: what Tenant {TENANT} has used, once the operator's next round has read the engine")
    tenant = _wait_metered(cluster, metered_before + answer.usage.completion_tokens, timeout=60)
    if tenant is None:
        print("   no metering round counted the completion within 60 s; see `kubectl get tenant -o yaml`")
    else:
        tokens = tenant.get("tokens") or {}
        gpu_seconds = ((tenant.get("usage") or {}).get("total") or {}).get("total", 0.0)
        print(f"   {gpu_seconds:.0f} GPU-seconds, {tokens.get('input', 0)} tokens in, "
              f"{tokens.get('output', 0)} out, cost so far ${tenant.get('cost', 0.0):.4f}")  # fmt: skip

    print()
    print(f"export KUBECONFIG={config.kubeconfig}")
    print(f"kubectl get fisvc -n {NAMESPACE}; kubectl get tenant {TENANT} -o yaml")
    print(f"curl {endpoint}/completions -H 'Content-Type: application/json' "
          """-d '{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8}'""")  # fmt: skip
    print("stop everything (operator, engine pods, cluster): flotilla cluster down")
    return 0
