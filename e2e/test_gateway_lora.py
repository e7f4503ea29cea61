"""LoRA adapters through the gateway on the real local cluster: the operator and the gateway each under
their least-privilege ServiceAccount (the gateway's reads LoRAAdapters), two tenants each with an adapter;
each key reaches only its own adapter (401, 403, 404 otherwise) and lists only its own in /v1/models (with
`parent`); a request for the adapter goes to the replica where the operator loaded it, and after the engine
pod is killed, a request is held until the new replica has the adapter loaded, then served."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from flotilla.cluster.handle import ClusterHandle, wait_for
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

pytestmark = pytest.mark.cluster

RUN = uuid.uuid4().hex[:6]
KEY_A, KEY_B = f"fl-a-{uuid.uuid4().hex}", f"fl-b-{uuid.uuid4().hex}"
TENANT_A, TENANT_B = f"lg-a-{RUN}", f"lg-b-{RUN}"
NS_A, NS_B = f"lga-{RUN}", f"lgb-{RUN}"


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


def _tenant(name: str, namespace: str) -> dict:
    return {"apiVersion": "flotilla.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": name},
            "spec": {"namespaces": [namespace], "gpuQuota": {"h100": 2}}}  # fmt: skip


def _adapter(name: str, namespace: str, service: str, folder: Path) -> dict:
    return {"apiVersion": "flotilla.dev/v1alpha1", "kind": "LoRAAdapter",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"inferenceService": service, "source": f"file://{folder}"}}  # fmt: skip


def _loaded_pods(obj: dict) -> list[str]:
    return [r["pod"] for r in (obj.get("status") or {}).get("replicas") or [] if r["phase"] == "Loaded"]


@pytest.fixture(scope="module")
def env(cluster: ClusterHandle, tmp_path_factory) -> Iterator[Env]:
    from flotilla.bench.engine.lora import write_random_adapter
    from flotilla.engine.model.config import ModelConfig

    workdir = tmp_path_factory.mktemp("gateway-lora")
    model = tiny_model(workdir / "tiny-llama")
    adapters = workdir / "adapters"
    for seed, name in enumerate(("sql", "faq")):
        write_random_adapter(adapters / name, ModelConfig.from_file(model / "config.json"), rank=8, seed=seed)
    install_manifests(cluster)
    master = workdir / "engine-token"
    master.write_text(uuid.uuid4().hex)
    operator = OperatorProcess(service_account_kubeconfig(cluster, workdir / "operator.kubeconfig"),
                               workdir / "operator.log", ("--engine-token-file", str(master)))  # fmt: skip
    token = service_account_token(cluster, OPERATOR_NS)
    gateway = GatewayProcess(kubeconfig_for(cluster, workdir / "gateway.kubeconfig", {"token": token}),
                             workdir / "gateway.log", OPERATOR_NS, master)  # fmt: skip
    for ns in (NS_A, NS_B):
        cluster.kubectl("create", "namespace", ns)
    lora = {"enabled": True, "maxLoras": 2, "maxLoraRank": 16, "adapterDir": str(adapters)}
    engine = {"kvCacheMemory": "64Mi", "maxNumSeqs": 4, "lora": lora}
    docs = [
        _tenant(TENANT_A, NS_A),
        _tenant(TENANT_B, NS_B),
        key_secret(TENANT_A, "first", KEY_A, OPERATOR_NS, f"{TENANT_A}-keys"),
        key_secret(TENANT_B, "first", KEY_B, OPERATOR_NS, f"{TENANT_B}-keys"),
        inference_service("base", model, NS_A, replicas=1, engine=engine),
        # Tenant B's base, at zero replicas: its adapter exists (for /v1/models and the 403s) but is loaded nowhere.
        inference_service("base", model, NS_B, replicas=0, served_name="tiny-b", engine=engine),
        _adapter("sql", NS_A, "base", adapters / "sql"),
        _adapter("faq", NS_B, "base", adapters / "faq"),
    ]
    operator.start()
    try:
        cluster.apply(yaml.safe_dump_all(docs))
        gateway.start()
        yield Env(cluster, gateway)
    finally:
        gateway.stop()
        for ns in (NS_A, NS_B):
            cluster.kubectl("delete", "loraadapter,fisvc", "--all", "-n", ns, "--timeout=60s", check=False)
        operator.stop()
        for ns in (NS_A, NS_B):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "tenant", TENANT_A, TENANT_B, "--wait=false", check=False)
        cluster.kubectl("delete", "secret", "-n", OPERATOR_NS, f"{TENANT_A}-keys", f"{TENANT_B}-keys",
                        "--ignore-not-found", check=False)  # fmt: skip


def test_each_key_reaches_only_its_own_adapter_and_a_killed_replica_is_waited_for(env: Env):
    loaded = wait_for(lambda: _loaded_pods(env.adapter("sql", NS_A)) or None, 300, "sql Loaded")
    assert loaded is not None
    (pod,) = loaded
    first = env.post("sql")
    assert first.status_code == 200 and first.json()["model"] == "sql", first.text
    # The base beside it, by its id (a bare "tiny" may be ambiguous with other tests' shared services).
    base = env.post(f"{NS_A}/base")
    assert base.status_code == 200 and base.json()["model"] == "tiny", base.text
    assert env.post(f"{NS_A}/sql").status_code == 200

    # Another tenant's adapter: 403 naming only what was sent; unknown: 404; no key: 401.
    for model, key in (("sql", KEY_B), ("faq", KEY_A), (f"{NS_B}/faq", KEY_A)):
        refused = env.post(model, key)
        assert refused.status_code == 403, refused.text
        # Only what the client sent: never the owner, its namespaces or its other adapters.
        assert refused.json()["error"]["message"] == f"your API key's tenant may not use the model {model!r}"
    assert env.post("nope").status_code == 404
    assert env.post("sql", key=None).status_code == 401

    mine, theirs = env.models(KEY_A), env.models(KEY_B)
    assert mine["sql"]["parent"] == "tiny" and "faq" not in mine
    assert theirs["faq"]["parent"] == "tiny-b" and "sql" not in theirs

    # The engine pod is killed: the request waits for the new replica to have the adapter, then is served.
    env.cluster.kubectl("delete", "pod", pod, "-n", NS_A, "--wait=false")
    after = env.post("sql")
    assert after.status_code == 200 and after.json()["model"] == "sql", after.text
    assert pod not in _loaded_pods(env.adapter("sql", NS_A))
