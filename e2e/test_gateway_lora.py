"""LoRA adapters of two tenants on one shared base service, through the gateway, on the real local cluster:
the operator and the gateway each under their least-privilege ServiceAccount (the gateway's reads
LoRAAdapters). The base InferenceService is in a namespace of the platform's shared Tenant
(`spec.shared: true`: its services are every tenant's, its GPUs its quota's); each tenant's
LoRAAdapter in its own namespace names it (spec.serviceNamespace), under the same name `sql`. Each key
reaches only its own adapter (401, 404 otherwise) and lists only its own in /v1/models (with
`parent`); the operator runs with its admission webhook, as a platform runs it: the shared base and both
tenants' adapters are admitted, an adapter on a base in another tenant's namespace is refused at create;
each tenant's status meters its own adapter's tokens, and the shared Tenant's the base's GPU time; after
the engine pod is killed, a request is held until the new replica has the adapter loaded, then served.

"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle, free_port, wait_for
from flotilla.gateway.cmd import key_secret
from flotilla.gateway.local import GatewayProcess, service_account_token
from flotilla.operator.cmd.local import (
    OPERATOR_NS,
    OperatorProcess,
    inference_service,
    install_manifests,
    kubeconfig_for,
    service_account_kubeconfig,
    tiny_model,
)
from flotilla.operator.controllers.webhook_tls import SECRET_NAME as WEBHOOK_TLS_SECRET
from flotilla.operator.tenancy.settings import WebhookSettings

pytestmark = pytest.mark.cluster

RUN = uuid.uuid4().hex[:6]
KEY_A, KEY_B = f"fl-a-{uuid.uuid4().hex}", f"fl-b-{uuid.uuid4().hex}"
TENANT_A, TENANT_B = f"lg-a-{RUN}", f"lg-b-{RUN}"
TENANT_SHARED = f"lg-s-{RUN}"  # the platform's shared Tenant (spec.shared), owning NS_SHARED
NS_A, NS_B = f"lga-{RUN}", f"lgb-{RUN}"
NS_SHARED = f"lgs-{RUN}"  # the shared Tenant's: every tenant's key may use its services
SERVED = f"tiny-{RUN}"  # the shared base's served name


class Env:
    def __init__(self, cluster: ClusterHandle, gateway: GatewayProcess) -> None:
        self.cluster, self.gateway = cluster, gateway

    def post(self, model: str, key: str | None = KEY_A) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"model": model, "prompt": "SELECT", "max_tokens": 3}
        return httpx.post(self.gateway.url + "/v1/completions", json=body, headers=headers, timeout=300,
                          trust_env=False)  # fmt: skip

    def models(self, key: str) -> dict[str, dict]:
        rsp = httpx.get(self.gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                        timeout=30, trust_env=False)  # fmt: skip
        return {m["id"]: m for m in rsp.json()["data"]}

    def adapter(self, name: str, namespace: str) -> dict:
        return self.cluster.get_json("loraadapter", name, "-n", namespace)

    def metered(self, tenant: str) -> dict[str, dict]:
        return (self.cluster.get_json("tenant", tenant).get("status") or {}).get("adapters") or {}


def _tenant(name: str, namespace: str, **spec) -> dict:
    return {"apiVersion": "flotilla.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": name},
            "spec": {"namespaces": [namespace], "gpuQuota": {"h100": 2}, **spec}}  # fmt: skip


def _adapter(name: str, namespace: str, folder: Path, base_ns: str = NS_SHARED) -> dict:
    return {"apiVersion": "flotilla.dev/v1alpha1", "kind": "LoRAAdapter",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"inferenceService": "base", "serviceNamespace": base_ns, "source": f"file://{folder}"}}  # fmt: skip


def _loaded_pods(obj: dict) -> list[str]:
    return [r["pod"] for r in (obj.get("status") or {}).get("replicas") or [] if r["phase"] == "Loaded"]


@pytest.fixture(scope="module")
def env(cluster: ClusterHandle, tmp_path_factory) -> Iterator[Env]:
    from flotilla.bench.engine.lora import write_random_adapter
    from flotilla.engine.model.config import ModelConfig

    workdir = tmp_path_factory.mktemp("gateway-lora")
    model = tiny_model(workdir / "tiny-llama")
    adapters = workdir / "adapters"
    for seed, name in enumerate(("sql-a", "sql-b")):
        write_random_adapter(adapters / name, ModelConfig.from_file(model / "config.json"), rank=8, seed=seed)
    install_manifests(cluster)
    master = workdir / "engine-token"
    master.write_text(uuid.uuid4().hex)
    # With its admission webhook (failurePolicy Fail), as a platform runs it.
    operator = OperatorProcess(service_account_kubeconfig(cluster, workdir / "operator.kubeconfig"),
                               workdir / "operator.log",
                               ("--engine-token-file", str(master), "--webhook-port", str(free_port())),
                               host_path_roots=(workdir,))  # fmt: skip
    token = service_account_token(cluster, OPERATOR_NS)
    gateway = GatewayProcess(kubeconfig_for(cluster, workdir / "gateway.kubeconfig", {"token": token}),
                             workdir / "gateway.log", OPERATOR_NS, master)  # fmt: skip
    for ns in (NS_A, NS_B, NS_SHARED):
        cluster.kubectl("create", "namespace", ns)
    lora = {"enabled": True, "maxLoras": 2, "maxLoraRank": 16, "adapterDir": str(adapters)}
    engine = {"kvCacheMemory": "64Mi", "maxNumSeqs": 4, "lora": lora}
    docs = [
        _tenant(TENANT_SHARED, NS_SHARED, shared=True),  # sharing is granted, not implied by no claim
        _tenant(TENANT_A, NS_A),
        _tenant(TENANT_B, NS_B),
        key_secret(TENANT_A, "first", KEY_A, OPERATOR_NS, f"{TENANT_A}-keys"),
        key_secret(TENANT_B, "first", KEY_B, OPERATOR_NS, f"{TENANT_B}-keys"),
        inference_service("base", model, NS_SHARED, replicas=1, served_name=SERVED, engine=engine),
        # Tenant B's own base, at zero replicas: tenant A's adapter may not name it.
        inference_service("base", model, NS_B, replicas=0, served_name=f"b-{RUN}", engine=engine),
        _adapter("sql", NS_A, adapters / "sql-a"),
        _adapter("sql", NS_B, adapters / "sql-b"),
    ]
    operator.start()
    try:
        cluster.apply_once_admitted(
            manifest_yaml.dump_all(docs),
            60,
            "the shared base and both tenants' adapters admitted by the webhook",
        )
        gateway.start()
        yield Env(cluster, gateway)
    finally:
        gateway.stop()
        # Adapters first (the operator unloads them from the shared base), then the services.
        for ns in (NS_A, NS_B):
            cluster.kubectl("delete", "loraadapter", "--all", "-n", ns, "--timeout=60s", check=False)
        for ns in (NS_A, NS_B, NS_SHARED):
            cluster.kubectl("delete", "fisvc", "--all", "-n", ns, "--timeout=60s", check=False)
        operator.stop()
        # The webhook and its TLS Secret go with this host-process operator.
        cluster.kubectl("delete", "validatingwebhookconfiguration", WebhookSettings().configuration,
                        "--ignore-not-found", check=False)  # fmt: skip
        cluster.kubectl("delete", "secret", WEBHOOK_TLS_SECRET, "-n", OPERATOR_NS, "--ignore-not-found",
                        check=False)  # fmt: skip
        for ns in (NS_A, NS_B, NS_SHARED):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "tenant", TENANT_A, TENANT_B, TENANT_SHARED, "--wait=false", check=False)
        cluster.kubectl("delete", "secret", "-n", OPERATOR_NS, f"{TENANT_A}-keys", f"{TENANT_B}-keys",
                        "--ignore-not-found", check=False)  # fmt: skip


def test_two_tenants_adapters_on_one_shared_base_each_key_reaches_its_own_and_is_metered(env: Env):
    loaded = {
        ns: wait_for(lambda ns=ns: _loaded_pods(env.adapter("sql", ns)) or None, 300, f"{ns}/sql Loaded")
        for ns in (NS_A, NS_B)
    }
    pods = loaded[NS_A]
    assert pods is not None and loaded[NS_B] == pods  # one replica, of the shared base
    (pod,) = pods
    for ns in (NS_A, NS_B):
        status = env.adapter("sql", ns)["status"]
        assert status["servedName"] == f"{ns}/sql", status  # the engine's name on the shared base

    # Each key's bare "sql" is its own tenant's adapter (the answer names the adapter's id).
    generated = {NS_A: 0, NS_B: 0}
    for key, ns in ((KEY_A, NS_A), (KEY_B, NS_B)):
        for model in ("sql", f"{ns}/sql"):
            answer = env.post(model, key)
            assert answer.status_code == 200 and answer.json()["model"] == f"{ns}/sql", answer.text
            generated[ns] += answer.json()["usage"]["completion_tokens"]
    base = env.post(SERVED)  # the shared base itself: every tenant's
    assert base.status_code == 200 and base.json()["model"] == SERVED, base.text

    # Another tenant's adapter: 404, as an unknown name; no key: 401.
    for model, key in ((f"{NS_B}/sql", KEY_A), (f"{NS_A}/sql", KEY_B), (f"{NS_A}/stolen", KEY_B)):
        refused = env.post(model, key)
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["message"] == f"the model {model!r} does not exist"
    assert env.post("nope").status_code == 404
    assert env.post("sql", key=None).status_code == 401

    mine, theirs = env.models(KEY_A), env.models(KEY_B)
    assert mine["sql"]["parent"] == SERVED and theirs["sql"]["parent"] == SERVED
    assert f"{NS_B}/sql" not in mine and f"{NS_A}/sql" not in theirs and "stolen" not in theirs

    # A base in another tenant's namespace: refused by the webhook, naming the field and the value; nothing
    # stored, so nothing to load or route.
    stolen = manifest_yaml.dump_all([_adapter("stolen", NS_A, Path("/nowhere"), base_ns=NS_B)])
    refused = env.cluster.kubectl("apply", "-f", "-", input=stolen, check=False)
    assert refused.returncode != 0 and "spec.serviceNamespace" in refused.stderr and NS_B in refused.stderr, (
        refused.stderr
    )
    assert env.cluster.kubectl("get", "loraadapter", "stolen", "-n", NS_A, check=False).returncode != 0
    assert env.post("stolen").status_code == 404

    # Metering: each tenant's status counts its own adapter's tokens (served by the shared engine as
    # `namespace/name`), and never the other's.
    for tenant, ns, other in ((TENANT_A, NS_A, NS_B), (TENANT_B, NS_B, NS_A)):
        usage = wait_for(
            lambda tenant=tenant, ns=ns: (
                (env.metered(tenant).get(f"{ns}/sql") or {}).get("output", 0) >= generated[ns]
                and env.metered(tenant)
            ),
            60,
            f"{tenant}'s metering of {ns}/sql",
        )
        assert usage is not None and f"{other}/sql" not in usage, usage
        # Exactly what its own requests generated: the other tenant's on the same engine never count.
        assert usage[f"{ns}/sql"]["output"] == generated[ns] and usage[f"{ns}/sql"]["input"] > 0, usage
    # The shared base's GPU time is the shared Tenant's (its quota, its budget), never nobody's.
    seconds = wait_for(
        lambda: (((env.cluster.get_json("tenant", TENANT_SHARED).get("status") or {}).get("usage") or {})
                 .get("total", {}).get("byNamespace", {}).get(NS_SHARED)),
        60,
        f"{TENANT_SHARED}'s metering of the shared base's GPU time",
    )  # fmt: skip
    assert seconds is not None and seconds > 0

    # The engine pod is killed: the request waits for the new replica to have the adapter, then is served.
    env.cluster.kubectl("delete", "pod", pod, "-n", NS_SHARED, "--wait=false")
    for key, ns in ((KEY_A, NS_A), (KEY_B, NS_B)):
        after = env.post("sql", key)
        assert after.status_code == 200 and after.json()["model"] == f"{ns}/sql", after.text
    for ns in (NS_A, NS_B):
        assert pod not in _loaded_pods(env.adapter("sql", ns))
