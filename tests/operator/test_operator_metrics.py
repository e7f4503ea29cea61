"""The operator's series for the monitoring rules: per-service figures and the TTFT target's bucket, the
Tenant's price, budget, month cost and last metering time, and admission refusals by reason."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from types import SimpleNamespace

import kopf
import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.utils import floatToGoString

from flotilla import contract
from flotilla.operator.api.v1alpha1 import MeteringLedger, TenantSpec, TenantStatus
from flotilla.operator.clients.quota_ledger import World
from flotilla.operator.config import OperatorConfig
from flotilla.operator.controllers import webhook_reviews
from flotilla.operator.controllers.sync import _write
from flotilla.operator.desired.status import service_figures
from flotilla.operator.metrics import SERVICES, ServiceCollector, ServiceFigures, slo_bucket
from flotilla.operator.tenancy.metering_metrics import TenantCollector, month_cost
from flotilla.operator.tenancy.reservations import parse, serialize


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def key(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def samples(collector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize(
    ("target", "le"),
    [(0.5, "0.5"), (0.6, "0.5"), (0.749, "0.5"), (1.0, "1.0"), (2.0, "2.0"), (600, "300.0"), (0.0005, None)],
)
def test_slo_bucket_is_the_largest_engine_bucket_at_or_below_the_target(target, le):
    assert slo_bucket(target) == le


def test_slo_buckets_are_spelled_as_the_engines_exposition_spells_them():
    from flotilla.engine.core.outputs import EngineStats
    from flotilla.engine.server.metrics import EngineMetrics

    text = generate_latest(EngineMetrics("m", lambda: EngineStats()).registry).decode()
    exposed = {
        line.split('le="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith(contract.TIME_TO_FIRST_TOKEN + "_bucket{")
    }
    assert {slo_bucket(b) for b in contract.LATENCY_BUCKETS} == exposed - {"+Inf"}
    assert {floatToGoString(b) for b in contract.LATENCY_BUCKETS} == exposed - {"+Inf"}


def test_service_figures_from_spec_and_status():
    status = {
        "desiredReplicas": 3,
        "readyReplicas": 2,
        "conditions": [{"type": "Ready", "status": "False"}, {"type": "Valid", "status": "True"}],
    }
    figures = service_figures({"autoscaling": {"maxReplicas": 4, "ttftP95TargetSeconds": 0.6}}, status)
    assert figures == ServiceFigures(
        ready=False, desired_replicas=3, ready_replicas=2, ttft_target_seconds=0.6
    )
    ready = {**status, "conditions": [{"type": "Ready", "status": "True"}]}
    assert service_figures({}, ready) == ServiceFigures(True, 3, 2, None)
    assert service_figures({}, {}) == ServiceFigures(False, 0, 0, None)


def test_service_series_and_a_changed_target_leaves_no_stale_bucket():
    collector = ServiceCollector()
    collector.update("ns", "chat", ServiceFigures(True, 2, 2, 0.6))
    collector.update("ns", "batch", ServiceFigures(False, 1, 0, None))
    got = samples(collector)
    chat = key(namespace="ns", service="chat")
    chat_target = (contract.SERVICE_TTFT_TARGET, key(namespace="ns", service="chat", le="0.5"))
    assert got[(contract.SERVICE_READY, chat)] == 1
    assert got[(contract.SERVICE_DESIRED_REPLICAS, chat)] == 2
    assert got[(contract.SERVICE_READY_REPLICAS, chat)] == 2
    assert got[chat_target] == 0.6
    assert got[(contract.SERVICE_READY, key(namespace="ns", service="batch"))] == 0
    assert [k for k in got if k[0] == contract.SERVICE_TTFT_TARGET] == [chat_target]

    collector.update("ns", "chat", ServiceFigures(True, 2, 2, 1.2))
    targets = [k for k in samples(collector) if k[0] == contract.SERVICE_TTFT_TARGET]
    assert targets == [(contract.SERVICE_TTFT_TARGET, key(namespace="ns", service="chat", le="1.0"))]
    collector.forget("ns", "chat")
    assert not [k for k in samples(collector) if ("service", "chat") in k[1]]


def _tenant(**spec) -> tuple[TenantStatus, TenantSpec]:
    ledger = MeteringLedger(
        total={"ns/chat/h100": 7200.0 * 3},
        daily={"2026-01-31": {"ns/chat/h100": 7200.0}, "2026-02-01": {"ns/chat/h100": 3600.0 * 4}},
    )
    status = TenantStatus(
        gpus_allocated={"h100": 2},
        gpu_quota={"h100": 8},
        ledger=ledger,
        cost=15.0,
        last_metered_time="2026-02-01T10:00:00.250000Z",
    )
    base = {"gpuQuota": {"h100": 8}, "pricePerGPUHour": {"h100": 2.5}}
    return status, TenantSpec.model_validate(base | spec)


def test_month_cost_counts_this_utc_month_only():
    status, spec = _tenant()
    assert month_cost(status, spec, ts("2026-02-01T12:00:00")) == 4 * 2.5
    assert month_cost(status, spec, ts("2026-01-31T23:00:00")) == 2 * 2.5
    assert month_cost(status, spec, ts("2026-03-01T00:00:00")) == 0


def test_tenant_series_price_budget_month_cost_and_last_metering():
    status, spec = _tenant(monthlyBudget=500)
    collector = TenantCollector(clock=lambda: ts("2026-02-01T12:00:00"))
    collector.update("a", status, spec)
    got = samples(collector)
    a = key(tenant="a")
    h100 = key(tenant="a", gpu_type="h100")
    assert got[(contract.TENANT_PRICE_PER_GPU_HOUR, h100)] == 2.5
    assert got[(contract.TENANT_MONTHLY_BUDGET, a)] == 500
    assert got[(contract.TENANT_MONTH_COST, a)] == 10.0
    assert got[(contract.TENANT_COST, a)] == 15.0
    assert got[(contract.TENANT_LAST_METERED, a)] == ts("2026-02-01T10:00:00.25")
    assert got[(contract.TENANT_GPUS_ALLOCATED, h100)] == 2
    seconds = key(tenant="a", gpu_type="h100", namespace="ns", service="chat")
    assert got[(contract.counter_total(contract.TENANT_GPU_SECONDS), seconds)] == 7200.0 * 3

    unbudgeted, spec = _tenant()
    collector.update("a", unbudgeted.model_copy(update={"last_metered_time": None}), spec)
    names = {name for name, _ in samples(collector)}
    assert contract.TENANT_MONTHLY_BUDGET not in names and contract.TENANT_LAST_METERED not in names


def test_monthly_budget_is_optional_and_not_negative():
    assert TenantSpec().monthly_budget is None
    assert TenantSpec.model_validate({"monthlyBudget": 0}).monthly_budget == 0
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        TenantSpec.model_validate({"monthlyBudget": -1})


def _denials(tenant: str, reason: str) -> float:
    name = contract.counter_total(contract.ADMISSION_DENIALS)
    return REGISTRY.get_sample_value(name, {"tenant": tenant, "reason": reason}) or 0.0


class MemoryLedger:
    """The webhook's ledger with the API's tenancy world and ConfigMaps held in memory (the real one is
    attacked on the cluster by e2e/test_admission_ha.py); here only the refusal counters are under test."""

    def __init__(self, tenants: dict[str, dict]):
        self.tenants, self.data, self.version = tenants, {}, 0

    def world(self) -> World:
        specs = {name: TenantSpec.model_validate(spec) for name, spec in self.tenants.items()}
        return World(tenants=specs, tenant_uids={name: "" for name in specs})

    def services(self) -> dict:
        return {}

    def read(self, tenant: str):
        return parse(tenant, self.data), str(self.version)

    def write(self, tenant, tenant_uid, reserved, version) -> bool:
        self.data, self.version = serialize(reserved), self.version + 1
        return True

    def read_claims(self):
        return {}, None

    def write_claims(self, data, version) -> bool:
        return True


def admit(body: dict, namespace: str, name: str, memo: kopf.Memo, dryrun: bool = False) -> None:
    # kopf passes many more keyword arguments; the handler reads only these.
    given: dict = {"body": body, "old": None, "namespace": namespace, "name": name, "dryrun": dryrun}
    webhook_reviews.admit_service(memo=memo, **given)


def test_admission_refusals_are_counted_by_tenant_and_reason():
    spec = {"gpuQuota": {"h100": 2}, "namespaces": ["team-m"]}
    runtime = SimpleNamespace(config=OperatorConfig(host_path_roots=("/m",)))  # the webhook reads only that
    memo = kopf.Memo(admission=MemoryLedger({"metrics-t": spec}), runtime=runtime)
    body = {
        "spec": {
            "model": {"uri": "file:///m"},
            "resources": {"gpus": 1, "gpuType": "h100"},
            "replicas": 3,
        }
    }
    before = _denials("metrics-t", "QuotaExceeded")
    with pytest.raises(kopf.AdmissionError):
        admit(body, "team-m", "chat", memo)
    assert _denials("metrics-t", "QuotaExceeded") == before + 1

    before = _denials("", "NoTenant")
    with pytest.raises(kopf.AdmissionError):
        admit(body, "nobodys", "chat", memo, dryrun=True)
    assert _denials("", "NoTenant") == before + 1

    before = _denials("metrics-u", "TenantConflict")
    tenant = {"spec": {"namespaces": ["team-m"]}}
    with pytest.raises(kopf.AdmissionError):
        webhook_reviews.admit_tenant(memo=memo, **{"body": tenant, "name": "metrics-u"})
    assert _denials("metrics-u", "TenantConflict") == before + 1

    # Admitted: nothing counted.
    ok = {"spec": {**body["spec"], "replicas": 1}}
    before = _denials("metrics-t", "QuotaExceeded")
    admit(ok, "team-m", "small", memo)
    assert _denials("metrics-t", "QuotaExceeded") == before


def test_each_reconcile_exports_the_service_figures_it_wrote():
    patched = []
    rt = SimpleNamespace(
        refused={},
        written_status={},
        kube=SimpleNamespace(patch_service_status=lambda ns, name, status: patched.append((ns, name))),
        lock=threading.Lock(),
    )
    status = {"desiredReplicas": 2, "readyReplicas": 1, "conditions": [{"type": "Ready", "status": "False"}]}
    obj = {
        "metadata": {"namespace": "ns-w", "name": "svc-w"},
        "spec": {"autoscaling": {"ttftP95TargetSeconds": 2}},
    }
    result = SimpleNamespace(children=[], status=status, events=[], pool_status=None)
    _write(rt, obj, result, ("ns-w", "svc-w"), apply=[])  # type: ignore[arg-type]
    assert patched == [("ns-w", "svc-w")]
    got = samples(SERVICES)
    svc = key(namespace="ns-w", service="svc-w")
    assert got[(contract.SERVICE_DESIRED_REPLICAS, svc)] == 2
    assert got[(contract.SERVICE_READY, svc)] == 0
    assert got[(contract.SERVICE_TTFT_TARGET, key(namespace="ns-w", service="svc-w", le="2.0"))] == 2
    SERVICES.forget("ns-w", "svc-w")


def test_adapter_series_from_the_status():
    from flotilla.operator.api.v1alpha1 import AdapterUsage

    status, spec = _tenant()
    status = status.model_copy(update={"adapters": {"ns/fr": AdapterUsage(input=7, output=3, cost=0.5)}})
    collector = TenantCollector(clock=lambda: ts("2026-02-01T12:00:00"))
    collector.update("a", status, spec)
    got = samples(collector)
    fr = {"tenant": "a", "namespace": "ns", "lora_name": "fr"}
    assert got[(contract.counter_total(contract.TENANT_ADAPTER_TOKENS), key(**fr, direction="input"))] == 7
    assert got[(contract.counter_total(contract.TENANT_ADAPTER_TOKENS), key(**fr, direction="output"))] == 3
    assert got[(contract.TENANT_ADAPTER_COST, key(**fr))] == 0.5


def test_the_token_scrape_reads_each_adapters_counters():
    from flotilla.operator.clients.token_scrape import parse_tokens

    text = (
        f"# TYPE {contract.NUM_REQUESTS_WAITING} gauge\n{contract.NUM_REQUESTS_WAITING} 0\n"
        f"# TYPE {contract.PROMPT_TOKENS} counter\n{contract.PROMPT_TOKENS}_total 30\n"
        f"# TYPE {contract.GENERATION_TOKENS} counter\n{contract.GENERATION_TOKENS}_total 20\n"
        f"# TYPE {contract.LORA_PROMPT_TOKENS} counter\n"
        f'{contract.LORA_PROMPT_TOKENS}_total{{lora_name="fr"}} 12\n'
        f'{contract.LORA_PROMPT_TOKENS}_total{{lora_name="de"}} 3\n'
        f"# TYPE {contract.LORA_GENERATION_TOKENS} counter\n"
        f'{contract.LORA_GENERATION_TOKENS}_total{{lora_name="fr"}} 8\n'
    )
    got = parse_tokens(text)
    assert got is not None and got.total.input == 30 and got.total.output == 20
    assert {n: (c.input, c.output) for n, c in got.adapters.items()} == {"de": (3, 0), "fr": (12, 8)}
