"""`flotilla demo`: the platform story on the running local cluster, end to end.

Flotilla is installed as a platform team installs it: `helm upgrade --install` of charts/flotilla, so the
operator runs as a pod (under its ServiceAccount, in-cluster config) with the admission webhook on. A
Tenant owns the `demo` namespace with a GPU quota; the webhook refuses an InferenceService over it; one
within it runs the real engine on `tiny-trained` (a small model trained on a synthetic corpus, on first use)
and serves LoRA adapters; the demo waits for Ready=True and asks it for one completion through the official
`openai` client; registers the demo adapter (`tiny-trained-runbook`, fine-tuned on deploy runbooks) as the
tenant's LoRAAdapter and asks the base and the adapter the same question through the gateway with the
tenant's key; then shows what metering counted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from flotilla import manifest_yaml

NAMESPACE = "demo"
TENANT = "demo-team"
SERVICE = "tiny-chat"
SERVED_NAME = "tiny-trained"
ADAPTER = "deploy-runbook"
ADAPTER_PRESET = "tiny-trained-runbook"
# A deploy-steps prompt about a service whose name the model knows (a corpus name, one token): the base
# answers with the steps in their usual order, the adapter with its house runbook (config file first).
ADAPTER_PROMPT = "How to deploy muru-api:"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir", type=Path, help="the cluster's state folder (default: the local cluster)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for Ready (default 600)")
    parser.set_defaults(func=run)


def _manifests(model_dir: Path, adapter_dir: Path) -> str:
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
        served_name=SERVED_NAME,
        engine={
            "kvCacheMemory": "64Mi",
            "maxNumSeqs": 8,
            # adapterDir: the node folder mounted into every replica; the adapters' file:// sources lie in it.
            "lora": {
                "enabled": True,
                "maxLoras": 2,
                "maxLoraRank": 16,
                "adapterDir": str(adapter_dir.parent),
            },
        },
    )
    return manifest_yaml.dump_all([tenant, service])


def _adapter_manifest(adapter_dir: Path) -> str:
    """The tenant's LoRAAdapter: its name is what requests send as `model`."""
    adapter = {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": ADAPTER, "namespace": NAMESPACE},
        "spec": {"inferenceService": SERVICE, "source": f"file://{adapter_dir}"},
    }
    return manifest_yaml.dump(adapter)


def _step(message: str) -> None:
    print(f"== {message}", flush=True)


def _flotilla(*args: str) -> None:
    """A `flotilla` command whose output (training progress) goes to the terminal as it comes."""
    subprocess.run([sys.executable, "-m", "flotilla.cli", *args], check=True, timeout=1800)


def _model(state_dir: Path) -> Path:
    """tiny-trained in the cluster's state folder, which pods reach at the same path (hostPath)."""
    model_dir = state_dir / "models" / SERVED_NAME
    if (model_dir / "config.json").exists():
        print(f"   reusing {model_dir}")
    else:
        print(f"   writing {model_dir}", flush=True)
        _flotilla("model", "init", "--preset", SERVED_NAME, str(model_dir))
    return model_dir


def _adapter(state_dir: Path) -> Path:
    """The demo adapter in the cluster's state folder, under the service's adapterDir."""
    adapter_dir = state_dir / "adapters" / ADAPTER
    if (adapter_dir / "adapter_model.safetensors").exists():
        print(f"   reusing {adapter_dir}")
    else:
        print(f"   writing {adapter_dir}", flush=True)
        _flotilla("model", "init-adapter", "--preset", ADAPTER_PRESET, str(adapter_dir))
    return adapter_dir


def _node_port(state_dir: Path, name: str) -> int:
    """A node port kept across demos, so an upgrade never moves the webhook's or the gateway's address."""
    from flotilla.operator.cmd import local_chart

    port_file = state_dir / f"{name}-node-port"
    port = int(port_file.read_text()) if port_file.exists() else local_chart.free_node_port()
    port_file.write_text(str(port))
    return port


def _install_chart(cluster, state_dir: Path, model_dir: Path, adapter_dir: Path) -> None:
    from flotilla.cluster.processes import ProcessTable
    from flotilla.operator.cmd import local_chart

    if not (local_chart.CHART_DIR / "Chart.yaml").exists():
        raise SystemExit(
            f"demo: {local_chart.CHART_DIR} not found; run the demo from the repository root (make demo)"
        )
    ProcessTable(state_dir / "pids").stop(
        "operator"
    )  # an older demo's host-process operator, by its pid record
    seconds = local_chart.install(
        cluster,
        # The model's folder and the service's adapterDir are the host paths the operator may mount.
        local_chart.local_values(
            _node_port(state_dir, "webhook"),
            (model_dir,),
            _node_port(state_dir, "gateway"),
            host_path_roots=(adapter_dir.parent,),
        ),
        log=lambda line: print(f"   {line}", flush=True),
    )
    print(f"   installed; the operator pod was Ready {seconds:.1f}s after helm started")
    print(
        "   "
        + cluster.kubectl("get", "pods", "-n", local_chart.NAMESPACE, "-o", "wide")
        .stdout.rstrip()
        .replace("\n", "\n   ")
    )


def _over_quota_refusal(cluster, model_dir: Path) -> str:
    """The webhook's answer to a service over the Tenant's quota (a server-side dry run changes nothing).
    On the demo's own model: a folder outside the operator's host-path roots would be refused for that."""
    from flotilla.operator.cmd.local import inference_service

    too_big = inference_service("too-big", model_dir, NAMESPACE, replicas=5)
    result = cluster.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=manifest_yaml.dump(too_big), check=False
    )
    if result.returncode == 0:
        raise SystemExit("demo: the webhook admitted a service over the Tenant's quota")
    return result.stderr.strip()


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

    _step(f"a small trained model (flotilla model init --preset {SERVED_NAME}; trained once, then cached)")
    model_dir = _model(state_dir)
    _step(
        f"its demo LoRA adapter (flotilla model init-adapter --preset {ADAPTER_PRESET}; seconds, then cached)"
    )
    adapter_dir = _adapter(state_dir)

    _step("Flotilla through its Helm chart: CRDs, RBAC, the operator as a pod, the admission webhook")
    installing = time.monotonic()
    _install_chart(cluster, state_dir, model_dir, adapter_dir)

    _step(f"Tenant {TENANT} owning namespace {NAMESPACE}, and InferenceService {SERVICE}")
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    print(cluster.apply(_manifests(model_dir, adapter_dir)).stdout.rstrip())

    _step("the webhook refuses a service over the Tenant's quota (5 replicas x 1 GPU > 4)")
    print(f"   {_over_quota_refusal(cluster, model_dir)}")

    _step(f"waiting for {SERVICE} to be Ready (the engine loads the model in its pod)")
    status = _wait_ready(cluster, args.timeout)
    endpoint = status["endpoints"][0]
    print(cluster.kubectl("get", "fisvc", "-n", NAMESPACE).stdout.rstrip())

    _step(f"one completion through the openai client at {endpoint}")
    metered_before = _metered_output(_tenant_status(cluster))  # an earlier demo's completions
    client = OpenAI(base_url=endpoint, api_key="unused", timeout=120)
    answer = client.completions.create(
        model=SERVED_NAME, prompt="The fleet sails", max_tokens=12, extra_body={"ignore_eos": True}
    )
    print(f"   text: {answer.choices[0].text!r}")
    print(
        f"   (the first completion, {time.monotonic() - installing:.1f}s after `helm upgrade --install` started)"
    )
    print(
        f"   usage: {answer.usage.prompt_tokens} prompt + {answer.usage.completion_tokens} completion tokens"
    )
    print(f"   ({SERVED_NAME} knows only its synthetic corpus: deploy steps, lists, code, short stories)")

    gateway = _through_the_gateway(cluster, state_dir)
    gateway += _adapter_through_the_gateway(cluster, state_dir, adapter_dir, args.timeout)

    _step(f"metering: what Tenant {TENANT} has used, once the operator's next round has read the engine")
    tenant = _wait_metered(cluster, metered_before + answer.usage.completion_tokens + gateway, timeout=60)
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
          f"""-d '{{"model": "{SERVED_NAME}", "prompt": "Hello", "max_tokens": 8}}'""")  # fmt: skip
    print(f"kubectl get flora -n {NAMESPACE}  # the tenant's LoRA adapters, loaded per replica")
    print(f"the gateway: OpenAI(base_url='http://127.0.0.1:{_node_port(state_dir, 'gateway')}/v1', "
          f"api_key=open('{state_dir / 'demo-api-key'}').read())")  # fmt: skip
    print(
        "remove Flotilla (keeps the CRDs and the tenants' objects): helm uninstall flotilla -n flotilla-system"
    )
    print("stop everything (operator, engine pods, cluster): flotilla cluster down")
    return 0


def _through_the_gateway(cluster, state_dir: Path) -> int:
    """A tenant API key (hashed in a Secret the gateway reads) and one completion through the gateway's
    node port; returns the completion tokens, for metering."""
    import httpx
    from openai import OpenAI

    from flotilla.cluster.handle import wait_for
    from flotilla.gateway.cmd import key_secret, new_key
    from flotilla.operator.cmd import local_chart

    base = f"http://127.0.0.1:{_node_port(state_dir, 'gateway')}/v1"
    _step(f"the gateway at {base}: an API key for {TENANT}, then one completion with it")
    key_file = state_dir / "demo-api-key"
    key = key_file.read_text().strip() if key_file.exists() else new_key()
    key_file.write_text(key)
    key_file.chmod(0o600)
    cluster.apply(json.dumps(key_secret(TENANT, "demo", key, local_chart.NAMESPACE, f"{TENANT}-api-keys")))
    print(f"   key in {key_file}; its SHA-256 in Secret {local_chart.NAMESPACE}/{TENANT}-api-keys")

    def answered() -> bool:
        try:
            rsp = httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        except httpx.TransportError:
            return False
        return rsp.status_code == 200 and bool(rsp.json()["data"])

    wait_for(answered, 120, "the gateway to know the key and the service")
    client = OpenAI(base_url=base, api_key=key, timeout=120, max_retries=0)
    answer = client.completions.create(
        model=SERVED_NAME, prompt="Through the gateway", max_tokens=8, extra_body={"ignore_eos": True}
    )
    print(
        f"   text: {answer.choices[0].text!r} (routed by prefix and load; the engine counted it for {TENANT})"
    )
    try:
        client.with_options(api_key="fl-not-a-key").models.list()
    except Exception as exc:  # openai.AuthenticationError
        print(f"   a wrong key: {type(exc).__name__}")
    return answer.usage.completion_tokens if answer.usage else 0


def _wait_adapter_loaded(cluster, timeout: float) -> None:
    """Until the operator reports the adapter Loaded in every ready replica (its Ready condition)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        result = cluster.kubectl("get", "flora", ADAPTER, "-n", NAMESPACE, "-o", "json", check=False)
        if result.returncode == 0:
            conditions = {
                c["type"]: c
                for c in (yaml.safe_load(result.stdout).get("status") or {}).get("conditions") or []
            }
            ready = conditions.get("Ready") or {}
            line = (
                f"   Ready={ready.get('status', '?')} {ready.get('reason', '')}: {ready.get('message', '')}"
            )
            if line != last:
                print(line, flush=True)
                last = line
            if ready.get("status") == "True":
                return
        time.sleep(2)
    raise SystemExit(
        f"demo: LoRAAdapter {ADAPTER} was not loaded after {timeout:.0f}s; see `kubectl describe flora`"
    )


def _adapter_through_the_gateway(cluster, state_dir: Path, adapter_dir: Path, timeout: float) -> int:
    """The tenant's LoRAAdapter on the service, then one prompt to the base and to the adapter through the
    gateway with the tenant's key; returns the completion tokens, for metering."""
    from openai import OpenAI

    _step(f"Tenant {TENANT}'s LoRA adapter {ADAPTER} on {SERVICE} (a LoRAAdapter; the operator loads it)")
    print(f"   {cluster.apply(_adapter_manifest(adapter_dir)).stdout.rstrip()}")
    _wait_adapter_loaded(cluster, timeout)
    print("   " + cluster.kubectl("get", "flora", "-n", NAMESPACE).stdout.rstrip().replace("\n", "\n   "))

    base = f"http://127.0.0.1:{_node_port(state_dir, 'gateway')}/v1"
    key = (state_dir / "demo-api-key").read_text().strip()
    client = OpenAI(base_url=base, api_key=key, timeout=120, max_retries=0)
    _step(f"the same prompt to the base and to the adapter, through the gateway: {ADAPTER_PROMPT!r}")
    tokens = 0
    texts = {}
    for model in (SERVED_NAME, ADAPTER):
        answer = client.completions.create(model=model, prompt=ADAPTER_PROMPT, max_tokens=120, temperature=0)
        texts[model] = answer.choices[0].text
        tokens += answer.usage.completion_tokens if answer.usage else 0
        print(f"   model {model}:")
        print("      " + texts[model].strip().replace("\n", "\n      "))
    same = texts[SERVED_NAME] == texts[ADAPTER]
    print(f"   the answers {'are the same (unexpected)' if same else 'differ'}: the adapter writes its house "
          "runbook (every step, the config file first), the base the steps in their usual order")  # fmt: skip
    return tokens
