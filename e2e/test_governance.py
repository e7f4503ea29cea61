"""The monitoring layer against a live fleet: every dashboard panel, recording rule and alert, evaluated by
the real Prometheus, returns data; each dashboard is drawn to a PNG from those results.

One recorded run (a module fixture) sets up the fleet:
  - the operator on the host, under its ServiceAccount, with the admission webhook, metering every 2 s, and
    `--prometheus-url` (the autoscaler reads its signals from the same Prometheus);
  - two Tenants, each with a gpuQuota, pricePerGPUHour, monthlyBudget and a namespace of its own, and three
    InferenceServices on the tiny model: in tenant A `chat` (autoscaled, min = max = 1, with a TTFT target,
    created at 0 replicas so that the autoscaler makes one scale change) and `batch`, in tenant B `assist`;
  - what a quiet fleet never shows is made to happen, so that no panel is skipped: the autoscaler's
    Prometheus is not up yet when `chat`'s pod becomes ready, so its reads fail (the scrape-failure
    counter), and an over-quota service is refused by the webhook twice, once on each side of a scrape (the
    refusals panels count an increase, which a counter first seen at 1 does not show);
  - the gateway on the host as the chart runs it (the picker, and the real Envoy in front of it), tenant A
    with an API key and rate limits far above its traffic, and completions through Envoy during the load,
    so that the Fleet dashboard's gateway row (the picker's series and Envoy's) has data;
  - Prometheus from `flotilla.monitoring.local.up`: kubernetes_sd through the API server for the engine
    pods, static targets for the operator, the picker and Envoy's /stats/prometheus, Flotilla's rules
    file, a 2 s scrape and evaluation interval;
  - load on every service from `flotilla engine bench serve` (shared prefixes, so the prefix cache hits),
    plus plain completions;
  - `chat` serves LoRA adapters (spec.engine.lora) and tenant A has a LoRAAdapter on it (a random PEFT
    folder), loaded into chat's replica and asked for completions alongside the load, so that the adapter
    panels and rules have data; Tenant A's status then meters the adapter's tokens and cost, and
    `flotilla usage` prints its row.

Then every panel query of every dashboard (`dashboards.panel_queries`, the variables set to tenant A, its
namespace, `chat` and the model), every recording rule's expression and every alert's signal (the alert's
expression with `bool` comparisons, `rules.Alert.signal`: a healthy fleet fires none of the alerts, but each
must be able to match) are evaluated until all have data, with a generous limit; a query that errors,
returns no series or only NaN fails the test, all of them named. The dashboards' variables must offer the
chosen values. Windows are the dashboards' own (`$__rate_interval` 1m, `$__range` 1h): a 1h `increase` or
`rate` needs only two samples in its window, so a few minutes of data fill them all.

The autoscaler's scale change and read failures happen before Prometheus's first scrape of the operator,
so their panels have series whose increase and rate are 0: a counter first seen at its value shows no
increase (the refusals are repeated across a scrape for that reason).

Each dashboard is drawn to `artifacts/<uid>.png` (or under FLOTILLA_ARTIFACTS_DIR) on Grafana's grid:
time series from range queries over the run, stats, gauges and tables from the instant results, and the
figures of the run go to `artifacts/governance.json`.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle, free_port, wait_for
from flotilla.cluster.processes import ProcessTable
from flotilla.gateway.cmd import key_secret
from flotilla.gateway.local import GatewayProcess, service_account_token
from flotilla.monitoring import dashboards, grafana, local, rules
from flotilla.operator.cmd.local import (
    OPERATOR_NS,
    OperatorProcess,
    complete,
    inference_service,
    install_manifests,
    kubeconfig_for,
    service_account_kubeconfig,
    tiny_model,
)

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("FLOTILLA_ARTIFACTS_DIR") or REPO / "artifacts")
RUN = uuid.uuid4().hex[:5]
WEBHOOK_CONFIG = "flotilla.dev"
INTERVAL = "2s"  # Prometheus's scrape and rule evaluation interval
METERING_INTERVAL = "2"
MODEL = "tiny"
TTFT_TARGET = 0.2  # chat's ttftP95TargetSeconds, near its TTFT: an engine bucket (the SLO rule's `le`)
ENGINE = {"kvCacheMemory": "64Mi", "maxNumSeqs": 4}
ADAPTER = "tone"  # tenant A's LoRAAdapter on chat
ADAPTER_REQUESTS = 40  # completions with the adapter, one a second or so, while the load runs
GATEWAY_KEY = "fl-governance-" + RUN  # tenant A's API key, for completions through the gateway
GATEWAY_REQUESTS = 20  # completions through Envoy and the picker, one a second or so, while the load runs
# Tenant A's rate limits: far above what the test sends (none is refused), so that the refusal series
# exist at 0.
RATE_LIMITS = {"requestsPerSecond": 1000, "tokensPerMinute": 10_000_000}
# Poisson arrivals for about 40 s per service, well within what three CPU engines serve at once, so the
# drawings show traffic over time rather than one burst; shared prefixes, so the prefix cache hits.
LOAD = ["--request-rate", "0.75", "--num-prompts", "30", "--max-concurrency", "4", "--input-len", "32",
        "--output-len", "16", "--prefix-len", "16"]  # fmt: skip
# Seconds to wait for every query to have data once the load is done: under the rules' 5m windows, which
# the load fills.
EVALUATION_LIMIT = 240


@dataclass
class Fleet:
    prometheus: str
    tenant_a: str
    tenant_b: str
    ns_a: str
    ns_b: str
    started: float  # when Prometheus started (Unix time): the drawings start here
    load: dict[str, dict] = field(default_factory=dict)  # service -> the load generator's figures
    passes: int = 0  # rounds of evaluating every query until all had data
    evaluated_at: float = 0.0  # Unix time of the last round
    kubeconfig: str = ""

    @property
    def values(self) -> dict[str, str]:
        """The dashboards' variables: tenant A, its namespace, its autoscaled service, the model."""
        return {"tenant": self.tenant_a, "namespace": self.ns_a, "service": "chat", "model": MODEL}


def _tenant(name: str, namespace: str, quota: int, price: float, budget: float, **extra) -> str:
    spec = {
        "namespaces": [namespace],
        "gpuQuota": {"h100": quota},
        "pricePerGPUHour": {"h100": price},
        "monthlyBudget": budget,
    } | extra
    return manifest_yaml.dump(
        {"apiVersion": "flotilla.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": name}, "spec": spec}
    )


def _api(url: str, path: str, params: dict) -> dict:
    """One Prometheus API call; an error answer (HTTP 400/422) comes back as its JSON, never raised."""
    query = urllib.parse.urlencode(params, doseq=True)
    try:
        with urllib.request.urlopen(f"{url}{path}?{query}", timeout=60) as rsp:
            return json.loads(rsp.read())
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        try:
            return json.loads(body)
        except ValueError:
            return {"status": "error", "error": f"HTTP {exc.code}: {body[:300]}"}


def _vector(url: str, promql: str) -> list[dict]:
    answer = _api(url, "/api/v1/query", {"query": promql})
    return answer["data"]["result"] if answer.get("status") == "success" else []


def _operator_sample(metrics: str, name: str, **labels: str) -> float:
    """The sum of one series family's samples on the operator's /metrics that carry `labels`."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _refuse_over_quota(cluster: ClusterHandle, namespace: str) -> str:
    """An InferenceService tenant A has no GPUs left for: the webhook refuses it (and counts the refusal)."""
    # hf://, no host path: the refusal is the quota's (a folder outside the host-path roots is refused first).
    extra = manifest_yaml.dump(inference_service("extra", "hf://flotilla/extra", namespace, engine=ENGINE))
    refused = cluster.kubectl("apply", "-f", "-", input=extra, check=False)
    assert refused.returncode != 0 and "quota" in refused.stderr, refused.stdout + refused.stderr
    return refused.stderr


def _adapter_load(endpoint: str, stop: threading.Event, answered: list[int]) -> None:
    """Completions with the adapter, about one a second, until `stop` or ADAPTER_REQUESTS answered."""
    while not stop.is_set() and len(answered) < ADAPTER_REQUESTS:
        complete(endpoint, f"Adapter prompt {len(answered)}", max_tokens=8, model=ADAPTER)
        answered.append(1)
        stop.wait(1.0)


def _gateway_load(url: str, model: str, stop: threading.Event, answered: list[int]) -> None:
    """Completions through the gateway (Envoy, asking the picker) with tenant A's key, about one a second."""
    while not stop.is_set() and len(answered) < GATEWAY_REQUESTS:
        body = {"model": model, "prompt": f"Through the gateway {len(answered)}", "max_tokens": 4}
        rsp = httpx.post(url + "/v1/completions", json=body, timeout=120, trust_env=False,
                         headers={"Authorization": f"Bearer {GATEWAY_KEY}"})  # fmt: skip
        assert rsp.status_code == 200, rsp.text
        answered.append(1)
        stop.wait(1.0)


def _adapter_loaded(cluster: ClusterHandle, namespace: str) -> bool:
    obj = cluster.get_json("loraadapter", ADAPTER, "-n", namespace)
    replicas = (obj.get("status") or {}).get("replicas") or []
    return bool(replicas) and all(r.get("phase") == "Loaded" for r in replicas)


def _bench_argv(endpoint: str, seed: int, out: Path) -> list[str]:
    """`flotilla engine bench serve` against one engine (its base URL, without /v1), figures to `out`."""
    return [sys.executable, "-m", "flotilla.cli", "engine", "bench", "serve", "--url",
            endpoint.removesuffix("/v1"), "--model", MODEL, *LOAD, "--seed", str(seed), "--no-progress",
            "--json", str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def fleet(cluster: ClusterHandle, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("governance")
    install_manifests(cluster)
    model = tiny_model(workdir / "tiny-llama")
    from flotilla.bench.engine.lora import write_random_adapter
    from flotilla.engine.model.config import ModelConfig

    adapter_dir = workdir / "adapters" / ADAPTER
    write_random_adapter(adapter_dir, ModelConfig.from_file(Path(model) / "config.json"), rank=8, seed=1)
    lora = {"enabled": True, "maxLoras": 2, "maxLoraRank": 16, "adapterDir": str(adapter_dir.parent)}
    f = Fleet("", f"gov-a-{RUN}", f"gov-b-{RUN}", f"gov-a-{RUN}", f"gov-b-{RUN}", 0.0)
    for ns in (f.ns_a, f.ns_b):
        cluster.kubectl("create", "namespace", ns)
    prom_port = free_port()
    f.prometheus = f"http://127.0.0.1:{prom_port}"
    master = workdir / "engine-token"
    master.write_text(uuid.uuid4().hex)
    operator = OperatorProcess(
        service_account_kubeconfig(cluster, workdir / "operator.kubeconfig"),
        workdir / "operator.log",
        ("--webhook-port", str(free_port()), "--metering-interval", METERING_INTERVAL,
         "--prometheus-url", f.prometheus, "--engine-token-file", str(master)),
        host_path_roots=(workdir,),  # the model and the adapterDir
    )  # fmt: skip
    gateway_kubeconfig = kubeconfig_for(
        cluster, workdir / "gateway.kubeconfig", {"token": service_account_token(cluster, OPERATOR_NS)}
    )
    gateway = GatewayProcess(gateway_kubeconfig, workdir / "gateway.log", OPERATOR_NS, master)
    keys = key_secret(f.tenant_a, "governance", GATEWAY_KEY, OPERATOR_NS, f"{f.tenant_a}-keys")
    pids = ProcessTable(workdir / "pids")
    benches: dict[str, subprocess.Popen] = {}
    operator.start()
    try:
        probe = manifest_yaml.dump(inference_service("probe", model, f.ns_a))
        wait_for(
            lambda: (
                "belongs to no tenant"
                in cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=probe, check=False).stderr
            ),
            60,
            "the admission webhook to answer",
        )
        cluster.apply(_tenant(f.tenant_a, f.ns_a, 2, 3.6, 1000, rateLimits=RATE_LIMITS))
        cluster.apply(manifest_yaml.dump(keys))
        cluster.apply(_tenant(f.tenant_b, f.ns_b, 2, 2.5, 5000))
        chat = inference_service(
            "chat", model, f.ns_a, served_name=MODEL, replicas=0, engine=ENGINE | {"lora": lora},
            autoscaling={"minReplicas": 1, "maxReplicas": 1, "ttftP95TargetSeconds": TTFT_TARGET,
                         "periodSeconds": 3, "ttftWindowSeconds": 600},
        )  # fmt: skip
        batch = inference_service("batch", model, f.ns_a, served_name=MODEL, engine=ENGINE)
        assist = inference_service("assist", model, f.ns_b, served_name=MODEL, engine=ENGINE)
        cluster.apply(manifest_yaml.dump_all([chat, batch, assist]))
        adapter = {"apiVersion": "flotilla.dev/v1alpha1", "kind": "LoRAAdapter",
                   "metadata": {"name": ADAPTER, "namespace": f.ns_a},
                   "spec": {"inferenceService": "chat", "source": f"file://{adapter_dir}"}}  # fmt: skip
        cluster.apply(manifest_yaml.dump(adapter))
        services = {("chat", f.ns_a), ("batch", f.ns_a), ("assist", f.ns_b)}
        endpoints = {
            name: wait_for(
                lambda name=name, ns=ns: (
                    (cluster.get_json("fisvc", name, "-n", ns).get("status") or {}).get("endpoints") or [None]
                )[0],
                420,
                f"{ns}/{name} to be ready",
            )
            for name, ns in sorted(services)
        }
        # Prometheus is not up yet: the autoscaler's reads of chat's ready pod fail, and it made its one
        # scale change (0 -> minReplicas).
        wait_for(
            lambda: (
                (m := operator.get("/metrics")[1])
                and _operator_sample(m, "flotilla_autoscaler_scrape_failures_total", service="chat") > 0
                and _operator_sample(m, "flotilla_autoscaler_scales_total", service="chat", direction="up")
            ),
            120,
            "the autoscaler to fail a read of the absent Prometheus, having scaled chat up",
        )
        _refuse_over_quota(cluster, f.ns_a)
        wait_for(lambda: _adapter_loaded(cluster, f.ns_a), 120, f"{ADAPTER} Loaded in chat's replica")
        complete(endpoints["chat"], "Before Prometheus", model=ADAPTER)

        gateway.start()
        assert gateway.envoy is not None
        envoy_stats = gateway.envoy.admin_url.removeprefix("http://") + "/stats/prometheus"

        rules_file = workdir / "flotilla-rules.yaml"
        rules_file.write_text(rules.render())
        f.started = time.time()
        local.up(
            cluster, workdir, port=prom_port, interval=INTERVAL, rule_files=[str(rules_file)],
            static_targets={"flotilla-operator": [f"127.0.0.1:{operator.metrics_port}"],
                            "flotilla-gateway": [gateway.picker_url.removeprefix("http://")],
                            "flotilla-gateway-envoy": [envoy_stats]},
            log=lambda _: None,
        )  # fmt: skip
        engines = f'up{{namespace=~"{f.ns_a}|{f.ns_b}"}} == 1'
        wait_for(
            lambda: (
                len(_vector(f.prometheus, engines)) == 3
                and _vector(f.prometheus, 'up{job="flotilla-operator"} == 1')
                and _vector(f.prometheus, 'up{job="flotilla-gateway"} == 1')
                and _vector(f.prometheus, 'up{job="flotilla-gateway-envoy"} == 1')
                and _vector(f.prometheus, f'flotilla_admission_denials_total{{tenant="{f.tenant_a}"}}')
            ),
            120,
            "Prometheus to discover and scrape the three engine pods (kubernetes_sd), the operator, the "
            "gateway's picker and its Envoy",
        )
        _refuse_over_quota(cluster, f.ns_a)  # the counter now goes from 1 to 2 in Prometheus
        denied = f'sum(flotilla_admission_denials_total{{tenant="{f.tenant_a}"}}) >= 2'
        wait_for(lambda: _vector(f.prometheus, denied), 60, "Prometheus to see the second refusal")

        for endpoint in endpoints.values():
            for prompt in ("Hello", "The fleet"):
                complete(endpoint, prompt, model=MODEL)
        adapter_stop, adapter_answered = threading.Event(), []
        adapter_load = threading.Thread(
            target=_adapter_load, args=(endpoints["chat"], adapter_stop, adapter_answered), daemon=True
        )
        adapter_load.start()
        gateway_stop, gateway_answered = threading.Event(), []
        gateway_load = threading.Thread(
            target=_gateway_load,
            args=(gateway.url, f"{f.ns_a}/batch", gateway_stop, gateway_answered),
            daemon=True,
        )
        gateway_load.start()
        benches |= {
            name: subprocess.Popen(
                _bench_argv(endpoint, seed, workdir / f"bench-{name}.json"),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed, (name, endpoint) in enumerate(endpoints.items())
        }
        for name, bench in benches.items():
            _, err = bench.communicate(timeout=300)
            assert bench.returncode == 0, f"bench serve against {name} failed: {err[-2000:]}"
            figures = json.loads((workdir / f"bench-{name}.json").read_text())
            f.load[name] = figures.get("summary", figures)
        adapter_load.join(timeout=120)
        adapter_stop.set()
        assert len(adapter_answered) >= ADAPTER_REQUESTS, f"{len(adapter_answered)} adapter completions"
        f.load[f"chat/{ADAPTER}"] = {"completions": len(adapter_answered)}
        gateway_load.join(timeout=120)
        gateway_stop.set()
        assert len(gateway_answered) >= GATEWAY_REQUESTS, f"{len(gateway_answered)} gateway completions"
        f.load["gateway"] = {"completions": len(gateway_answered)}
        f.kubeconfig = str(cluster.kubeconfig)
        yield f
    finally:
        for bench in benches.values():
            if bench.poll() is None:
                bench.kill()
                bench.wait(timeout=30)
        pids.stop(local.PROCESS)
        gateway.stop()
        cluster.kubectl("delete", "secret", "-n", OPERATOR_NS, f"{f.tenant_a}-keys", "--ignore-not-found")
        # The autoscaler is a kopf daemon, guarded by kopf's finalizer: delete while the operator runs.
        cluster.kubectl("delete", "loraadapter", "--all", "-n", f.ns_a, "--timeout=60s", check=False)
        for ns in (f.ns_a, f.ns_b):
            cluster.kubectl("delete", "fisvc", "--all", "-n", ns, "--timeout=60s", check=False)
        operator.stop()
        # failurePolicy Fail: a configuration whose operator is gone would refuse every later write.
        cluster.kubectl("delete", "validatingwebhookconfiguration", WEBHOOK_CONFIG, "--ignore-not-found")
        for ns in (f.ns_a, f.ns_b):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl(
            "delete", "tenant", f.tenant_a, f.tenant_b, "--ignore-not-found", "--wait=false", check=False
        )


# -- what is evaluated ------------------------------------------------------------------------------------------


@dataclass
class Query:
    kind: str  # "panel" | "rule" | "alert" | "variable"
    where: str  # "dashboard uid / panel title", the rule's or the alert's name, "uid / $variable"
    expr: str
    panel: tuple[str, int] | None = None  # (dashboard uid, panel id) of a panel query
    target: dict | None = None  # its target: refId and legend
    label: str = ""  # a variable's label, and the value it must list
    wanted: str = ""
    series: list[dict] = field(default_factory=list)  # the instant result
    error: str | None = None
    ranged: list[dict] = field(default_factory=list)  # the range result, for drawing

    @property
    def problem(self) -> str | None:
        if self.error:
            return f"error: {self.error}"
        if not self.series:
            return "no series"
        if self.kind != "variable" and all(math.isnan(_value(s)) for s in self.series):
            return "only NaN"
        return None


def _value(series: dict) -> float:
    return float(series["value"][1])


_LABEL_VALUES = re.compile(r"label_values\((?P<series>.+), (?P<label>\w+)\)$")


def queries(values: dict[str, str]) -> list[Query]:
    """Every panel query (variables substituted), recording rule, alert signal and variable, in order."""
    out: list[Query] = []
    found = iter(dashboards.panel_queries(values))
    for board in dashboards.dashboards():
        for panel in grafana.panels(board):
            for target in panel["targets"]:
                uid, title, expr = next(found)
                assert (uid, title) == (board["uid"], panel["title"])
                out.append(Query("panel", f"{uid} / {title}", expr, (uid, panel["id"]), target))
    assert next(found, None) is None
    out += [Query("rule", r.name, r.expr) for r in rules.records()]
    out += [Query("alert", a.name, a.signal) for a in rules.alerts()]
    for board in dashboards.dashboards():
        fill = {v["name"]: grafana.ALL for v in board["templating"]["list"]} | dict(values)
        for variable in board["templating"]["list"]:
            if variable["type"] != "query":
                continue
            parsed = _LABEL_VALUES.match(variable["query"])
            assert parsed, variable["query"]
            selector = grafana.substitute(parsed["series"], fill)
            out.append(
                Query("variable", f"{board['uid']} / ${variable['name']}", selector,
                      label=parsed["label"], wanted=values[parsed["label"]])
            )  # fmt: skip
    return out


def _evaluate(url: str, query: Query) -> None:
    if query.kind == "variable":
        answer = _api(url, f"/api/v1/label/{query.label}/values", {"match[]": query.expr})
        listed = answer.get("data") or []
        query.error = None if answer.get("status") == "success" else str(answer.get("error"))
        query.series = [{"metric": {}, "value": [0, "1"]}] if query.wanted in listed else []
        return
    answer = _api(url, "/api/v1/query", {"query": query.expr})
    if answer.get("status") != "success":
        query.error, query.series = str(answer.get("error") or answer), []
        return
    data = answer["data"]
    result = data["result"]
    query.error = None
    query.series = result if data["resultType"] == "vector" else [{"metric": {}, "value": result}]


def _evaluate_range(url: str, query: Query, start: float, end: float) -> None:
    step = max(2.0, (end - start) / 300)
    answer = _api(url, "/api/v1/query_range", {"query": query.expr, "start": start, "end": end, "step": step})
    query.ranged = answer["data"]["result"] if answer.get("status") == "success" else []


@pytest.fixture(scope="module")
def evaluated(fleet: Fleet) -> list[Query]:
    """Every query, evaluated until each has data (or the limit passes); the panels' range results too."""
    found = queries(fleet.values)
    deadline = time.monotonic() + EVALUATION_LIMIT
    while True:
        fleet.passes += 1
        for query in found:
            _evaluate(fleet.prometheus, query)
        if not any(q.problem for q in found) or time.monotonic() > deadline:
            break
        time.sleep(5)
    fleet.evaluated_at = time.time()
    for query in found:
        if query.kind == "panel":
            _evaluate_range(fleet.prometheus, query, fleet.started, fleet.evaluated_at)
    return found


# -- the tests ----------------------------------------------------------------------------------------------------


def test_every_panel_rule_and_alert_query_returns_data(fleet: Fleet, evaluated: list[Query]):
    counts = {
        kind: (len(qs := [q for q in evaluated if q.kind == kind]), sum(1 for q in qs if not q.problem))
        for kind in ("panel", "rule", "alert", "variable")
    }
    panels = {q.panel for q in evaluated if q.kind == "panel"}
    report = {
        "panels": len(panels),
        "queries": {kind: {"evaluated": n, "with data": ok} for kind, (n, ok) in counts.items()},
        "values": fleet.values,
        "evaluation rounds": fleet.passes,
        "seconds of Prometheus data": round(fleet.evaluated_at - fleet.started, 1),
        "load": fleet.load,
        "series": _series_counts(fleet),
        "problems": [
            {"kind": q.kind, "where": q.where, "expr": q.expr, "problem": q.problem}
            for q in evaluated
            if q.problem
        ],
    }
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "governance.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\ngovernance: {len(panels)} panels; " + "; ".join(
        f"{kind} queries {ok}/{n} with data" for kind, (n, ok) in counts.items()
    ))  # fmt: skip
    # The check itself tells: a misspelled series has no data, a syntax error is an error.
    misspelled, broken = (
        Query("rule", "misspelled", "flotilla_no_such_series"),
        Query("rule", "broken", "sum("),
    )
    for canary in (misspelled, broken):
        _evaluate(fleet.prometheus, canary)
    assert misspelled.problem == "no series" and (broken.problem or "").startswith("error:"), (
        misspelled.problem,
        broken.problem,
    )
    problems = [f"{q.kind} {q.where}: {q.problem}\n    {q.expr}" for q in evaluated if q.problem]
    assert not problems, f"{len(problems)} queries without data:\n" + "\n".join(problems)


def _series_counts(fleet: Fleet) -> dict[str, int]:
    """How many series one service and one tenant cost Prometheus (docs/monitoring.md quotes these)."""
    service = f'namespace="{fleet.ns_a}",service="chat"'
    counts = {
        "scraped from one engine pod": f'count({{__name__=~"flotilla_.*",namespace="{fleet.ns_a}",pod=~"chat-.*"}})',
        "operator series of one service": f'count({{job="flotilla-operator",{service}}})',
        "operator series of one tenant": f'count({{job="flotilla-operator",tenant="{fleet.tenant_a}"}})',
        "recorded series of one service": f'count({{__name__=~"flotilla:.*",{service}}})',
        "recorded series of one tenant": f'count({{__name__=~"flotilla:.*",tenant="{fleet.tenant_a}"}})',
    }
    return {
        what: int(_value(found[0])) if (found := _vector(fleet.prometheus, q)) else 0
        for what, q in counts.items()
    }


def test_the_tenant_meters_its_adapter_and_flotilla_usage_prints_it(fleet: Fleet, cluster: ClusterHandle):
    """Tenant A's status carries the adapter's tokens (a share of the tenant's) and cost; `flotilla usage`
    prints the adapter's row."""
    key = f"{fleet.ns_a}/{ADAPTER}"

    def metered() -> dict | None:
        status = cluster.get_json("tenant", fleet.tenant_a).get("status") or {}
        usage = (status.get("adapters") or {}).get(key) or {}
        done = usage.get("input", 0) > 0 and usage.get("output", 0) > 0 and usage.get("cost", 0) > 0
        return status if done else None

    status = wait_for(metered, 60, f"tenant A's status to meter {key}")
    usage, tokens = status["adapters"][key], status["tokens"]
    assert usage["input"] <= tokens["input"] and usage["output"] <= tokens["output"], (usage, tokens)
    per_million = status["costPerMillionTokens"]
    assert usage["cost"] == pytest.approx((usage["input"] + usage["output"]) * per_million / 1e6, rel=0.05)
    assert list(status["adapters"]) == [key]  # only the tenant's LoRAAdapters
    printed = subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "usage", "--tenant", fleet.tenant_a, "--kubeconfig",
         fleet.kubeconfig, "--format", "csv"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    rows = [line.split(",") for line in printed.splitlines()]
    assert [fleet.tenant_a, fleet.ns_a, ADAPTER] in [row[:3] for row in rows], printed


def test_each_dashboard_is_drawn_from_those_results(fleet: Fleet, evaluated: list[Query]):
    by_panel: dict[tuple[str, int], list[Query]] = {}
    for query in evaluated:
        if query.panel is not None:
            by_panel.setdefault(query.panel, []).append(query)
    paths, empty = [], []
    for board in dashboards.dashboards():
        path = ARTIFACTS / f"{board['uid']}.png"
        empty += _draw(board, by_panel, path, fleet)
        paths.append(path)
    print("\ndashboards drawn: " + ", ".join(str(p) for p in paths))
    assert all(p.exists() and p.stat().st_size > 10_000 for p in paths), paths
    assert not empty, f"panels drawn without a line or a value: {empty}"


# -- drawing --------------------------------------------------------------------------------------------------------

_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
UNIT_HEIGHT = 0.42  # inches per Grafana grid row; a column is one inch
TITLE_HEIGHT = 0.8


def _legend(target: dict, metric: dict) -> str:
    fmt = target.get("legendFormat") or "__auto"
    if fmt == "__auto":
        labels = {k: v for k, v in metric.items() if k != "__name__"}
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or metric.get("__name__", "value")
    return _LEGEND.sub(lambda m: metric.get(m.group(1), ""), fmt)


def _format(value: float, panel: dict) -> str:
    defaults = panel["fieldConfig"]["defaults"]
    unit, decimals = defaults.get("unit", "short"), defaults.get("decimals")
    if math.isnan(value):
        return "NaN"
    if unit == "percentunit":
        return f"{value:.{1 if decimals is None else decimals}%}"
    text = f"{value:.{decimals}f}" if decimals is not None else f"{value:.3g}"
    return {"s": f"{text} s", "reqps": f"{text} req/s", "ops": f"{text} /s"}.get(unit, text)


def _draw(board: dict, by_panel: dict[tuple[str, int], list[Query]], path: Path, fleet: Fleet) -> list[str]:
    """The dashboard on Grafana's 24-column grid; returns the titles of panels that drew nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    fig_w, fig_h = grafana.GRID_COLUMNS, TITLE_HEIGHT + rows * UNIT_HEIGHT + 0.2
    fig = plt.figure(figsize=(fig_w, fig_h))

    def rect(pos: dict, pad: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
        """A grid position as figure fractions, less padding (left, right, bottom, top) in inches."""
        left, right, bottom, head = pad
        upper = TITLE_HEIGHT + pos["y"] * UNIT_HEIGHT + head  # inches from the figure's top
        lower = TITLE_HEIGHT + (pos["y"] + pos["h"]) * UNIT_HEIGHT - bottom
        return ((pos["x"] + left) / fig_w, 1 - lower / fig_h, (pos["w"] - left - right) / fig_w,
                (lower - upper) / fig_h)  # fmt: skip

    variables = ", ".join(f"{k}={v}" for k, v in fleet.values.items())
    fig.suptitle(f"{board['title']}    ({variables}; live fleet, Prometheus {INTERVAL} scrape)", fontsize=15)
    empty = []
    for panel in board["panels"]:
        pos = panel["gridPos"]
        if panel["type"] == "row":
            ax = fig.add_axes(rect(pos, (0.1, 0.1, 0.0, 0.0)))
            ax.axis("off")
            ax.text(0, 0.5, panel["title"], fontsize=13, weight="bold", va="center")
            continue
        ax = fig.add_axes(rect(pos, (0.55, 0.15, 0.45, 0.35)))
        ax.set_title(panel["title"], fontsize=10, loc="left")
        ax.tick_params(labelsize=7)
        drew = {
            "timeseries": _timeseries,
            "stat": _stat,
            "gauge": _bars,
            "bargauge": _bars,
            "table": _table,
        }[panel["type"]](ax, panel, by_panel.get((board["uid"], panel["id"]), []), fleet.started)
        if not drew:
            empty.append(f"{board['uid']} / {panel['title']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=60)
    plt.close(fig)
    return empty


def _timeseries(ax, panel: dict, found: list[Query], started: float) -> int:
    drew = 0
    for query in found:
        for series in query.ranged:
            xs = [float(t) - started for t, _ in series["values"]]
            ys = [float(v) for _, v in series["values"]]
            ax.plot(xs, ys, lw=1.2, label=_legend(query.target or {}, series["metric"])[:48])
            drew += 1
    unit = panel["fieldConfig"]["defaults"].get("unit", "short")
    if unit not in ("short", "none"):
        ax.set_ylabel(unit, fontsize=7)
    ax.set_xlabel("seconds since Prometheus started", fontsize=7)
    ax.grid(alpha=0.3)
    if drew:
        ax.legend(fontsize=6, loc="upper left", ncol=1 if drew <= 6 else 2)
    return drew


def _instant(found: list[Query]) -> list[tuple[str, float]]:
    return [(_legend(q.target or {}, s["metric"]), _value(s)) for q in found for s in q.series]


def _stat(ax, panel: dict, found: list[Query], started: float) -> int:
    ax.axis("off")
    shown = _instant(found)
    for i, (legend, value) in enumerate(shown[:6]):
        y = 0.75 - i * (0.6 / max(1, len(shown[:6]) - 1)) if len(shown) > 1 else 0.45
        size = 22 if len(shown) == 1 else 13
        ax.text(0.5, y, _format(value, panel), ha="center", va="center", fontsize=size, weight="bold",
                color="tab:green")  # fmt: skip
        ax.text(0.5, y - 0.14, legend[:40], ha="center", va="center", fontsize=7, color="gray")
    return len(shown)


def _bars(ax, panel: dict, found: list[Query], started: float) -> int:
    shown = _instant(found)
    labels = [legend[:36] for legend, _ in shown]
    values = [0.0 if math.isnan(v) else v for _, v in shown]
    ax.barh(range(len(values)), values, color="tab:blue", alpha=0.7)
    ax.set_yticks(range(len(values)), labels, fontsize=7)
    limit = panel["fieldConfig"]["defaults"].get("max")
    if limit is not None:
        ax.set_xlim(0, max(limit, *values) if values else limit)
    for i, (_, value) in enumerate(shown):
        ax.text(values[i], i, " " + _format(value, panel), va="center", fontsize=7)
    ax.invert_yaxis()
    return len(shown)


def _table(ax, panel: dict, found: list[Query], started: float) -> int:
    ax.axis("off")
    organize = next(t for t in panel["transformations"] if t["id"] == "organize")["options"]
    names = organize["renameByName"]  # "Value #A" -> the column's title
    labels = [k for k in organize["indexByName"] if not k.startswith("Value #")]
    rows: dict[tuple[str, ...], dict[str, str]] = {}
    for query in found:
        column = names[f"Value #{(query.target or {})['refId']}"]
        for series in query.series:
            key = tuple(series["metric"].get(label, "") for label in labels)
            rows.setdefault(key, {})[column] = _format(_value(series), panel)
    if rows:
        cells = [[*key, *(row.get(c, "") for c in names.values())] for key, row in sorted(rows.items())]
        table = ax.table(cellText=cells, colLabels=[*labels, *names.values()], loc="upper center",
                         cellLoc="left")  # fmt: skip
        table.auto_set_font_size(False)
        table.set_fontsize(7)
    return len(rows)
