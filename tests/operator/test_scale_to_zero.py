"""Scale to zero and back: the idle rule, the demand annotation, and what the rule never does on its own.
Driven through ServiceAutoscaler.step with the engine's real /metrics text, as the daemon drives it."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from prometheus_client import generate_latest

from flotilla.contract import (
    CONDITION_DEGRADED,
    CONDITION_QUOTA_ADMITTED,
    REASON_QUOTA_LIMITED,
)
from flotilla.engine.core.outputs import EngineStats
from flotilla.engine.server.metrics import EngineMetrics
from flotilla.operator.api.v1alpha1 import Autoscaling, TenantSpec
from flotilla.operator.autoscaling.autoscaler import ServiceAutoscaler, autoscaling_status
from flotilla.operator.autoscaling.rule import Inputs, PodSample, Policy, scale_target
from flotilla.operator.autoscaling.scale_to_zero import (
    Activity,
    IdleClock,
    demand_time,
    fresh_demand,
)
from flotilla.operator.autoscaling.signals import Signals
from flotilla.operator.clients.engine_metrics import PodScraper, ScrapeError, parse_engine_metrics
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.reconcile import World, plan
from flotilla.operator.desired.status import PodView
from flotilla.operator.tenancy.quota import QuotaDecision

IDLE = 300


class Engine:
    """An engine pod's /metrics: the engine's own exporter, its stats set by hand."""

    def __init__(self) -> None:
        self.stats = EngineStats()
        self.metrics = EngineMetrics("tiny", lambda: self.stats)

    def text(self) -> str:
        return generate_latest(self.metrics.registry).decode()


def spec(**kw) -> Autoscaling:
    wire = {"minReplicas": 0, "maxReplicas": 4, "queueDepthTarget": 2, "scaleToZeroAfterSeconds": IDLE}
    return Autoscaling.model_validate(wire | kw)


def pod(name="a", ready=True) -> PodView:
    return PodView(name=name, ip="127.0.0.9", ready=ready, restarts=0, trouble=None)


class Service:
    """One autoscaled service between decisions: its pods' engines, the scraper and the autoscaler."""

    def __init__(self, replicas: int = 1, **spec_kw) -> None:
        self.spec = spec(**spec_kw)
        self.current = replicas
        self.engines = {f"p{i}": Engine() for i in range(replicas)}
        self.scraper, self.scaler = PodScraper(60), ServiceAutoscaler()
        self.fail: set[str] = set()

    def step(self, now: float, *, demand: bool = False, quota: QuotaDecision | None = None):
        scraped: dict = {
            n: ScrapeError("refused") if n in self.fail else parse_engine_metrics(e.text())
            for n, e in self.engines.items()
        }
        signals = self.scraper.signals(now, scraped, set(self.engines))
        step = self.scaler.step(
            now=now,
            spec=self.spec,
            current=self.current,
            pods=[pod(n) for n in self.engines],
            signals=signals,
            quota=quota,
            demand=demand,
        )
        self.current = step.outcome.desired
        if self.current == 0:
            self.engines = {}
        return step


# ---- idle -> zero ----------------------------------------------------------------------------------


def test_idle_goes_to_zero_after_the_period_and_not_before():
    svc = Service()
    for now in range(0, IDLE, 15):
        step = svc.step(now)
        assert step.outcome.desired == 1, now  # the metrics rule keeps one replica: waiting 0 proposes 0
    step = svc.step(IDLE)
    assert (step.outcome.desired, step.outcome.reason) == (0, "Idle")
    assert "idle for 300s" in step.outcome.message


def test_the_metrics_rule_never_recommends_zero_on_its_own():
    # minReplicas 0, no waiting: the queue rule's HPA arithmetic says 0; the result is still 1.
    policy = Policy(min_replicas=0, max_replicas=4, queue_depth_target=2.0, scale_down_window=0)
    out = scale_target(Inputs(now=1000, current=3, pods=[PodSample("a", True, 0.0)], ttft_p95=None,
                              ttft_complete=True, policy=policy))  # fmt: skip
    assert (out.recommendation, out.desired) == (0, 1)
    # Even with a scale-to-zero period, until the idle rule says so.
    policy = Policy(min_replicas=0, max_replicas=4, queue_depth_target=2.0, scale_to_zero_after=IDLE)
    out = scale_target(Inputs(now=1000, current=1, pods=[PodSample("a", True, 0.0)], ttft_p95=None,
                              ttft_complete=True, policy=policy, idle_for=IDLE - 1))  # fmt: skip
    assert out.desired == 1


def test_busy_never_goes_to_zero():
    svc = Service()
    svc.engines["p0"].stats.num_running = 1  # one long request, nothing waiting
    for now in range(0, 4 * IDLE, 15):
        assert svc.step(now).outcome.desired >= 1, now
    svc.engines["p0"].stats.num_running = 0
    svc.engines["p0"].stats.num_waiting = 1
    for now in range(4 * IDLE, 8 * IDLE, 15):
        assert svc.step(now).outcome.desired >= 1, now


def test_served_tokens_restart_the_idle_clock():
    svc = Service()
    svc.step(0)
    svc.engines["p0"].stats.generation_tokens = 40  # a request came and went between two decisions
    assert svc.step(200).outcome.desired == 1
    assert svc.step(IDLE + 10).outcome.desired == 1  # idle only since 200
    assert svc.step(200 + IDLE).outcome.desired == 0


def test_min_replicas_one_never_goes_to_zero():
    svc = Service(minReplicas=1)
    for now in range(0, 4 * IDLE, 15):
        step = svc.step(now)
        assert step.outcome.desired == 1 and step.outcome.reason != "Idle", now


def test_a_pod_that_does_not_answer_never_lets_it_go_to_zero():
    svc = Service(replicas=2)
    svc.fail = {"p1"}
    for now in range(0, 3 * IDLE, 15):
        assert svc.step(now).outcome.desired >= 1, now
    svc.fail = set()
    assert svc.step(3 * IDLE).outcome.desired == 0  # idle all along: the counters never moved


def test_a_fresh_demand_keeps_an_idle_service_up_and_a_stale_one_does_not():
    svc = Service()
    svc.step(0)
    assert svc.step(IDLE, demand=True).outcome.desired == 1
    assert svc.step(IDLE + 15, demand=False).outcome.desired == 0


def test_a_scale_up_restarts_the_idle_clock():
    clock = IdleClock()
    quiet = Activity(known=True, busy=False)
    assert clock.observe(0, 0, quiet) == 0
    assert clock.observe(100, 0, quiet) == 100
    assert clock.observe(150, 1, quiet) == 0  # from zero: the new replica gets a whole period to load
    assert clock.observe(160, 1, Activity(known=False, busy=False)) is None
    assert clock.observe(170, 1, quiet) == 20


# ---- demand -> one replica -------------------------------------------------------------------------


def test_demand_at_zero_scales_to_one():
    svc = Service(replicas=0)
    step = svc.step(0)
    assert (step.outcome.desired, step.outcome.reason) == (0, "ScaledToZero")
    step = svc.step(1, demand=True)
    assert (step.outcome.desired, step.outcome.reason) == (1, "Demand")
    status = autoscaling_status(step, previous=None, now="2030-01-01T00:00:00Z", generation=1, scaled=True)
    assert (status["reason"], status["desiredReplicas"]) == ("Demand", 1)
    assert status["lastScaleTime"] == "2030-01-01T00:00:00Z"
    active = next(c for c in status["conditions"] if c["type"] == "ScalingActive")
    assert (active["status"], active["reason"]) == ("False", "Demand")


def test_without_demand_zero_stays_zero():
    svc = Service(replicas=0)
    for now in range(0, 2 * IDLE, 15):
        assert svc.step(now).outcome.desired == 0


def test_a_demand_the_quota_refuses_still_asks_for_one_and_says_so():
    # The reconciler holds it back (and says so in the InferenceService's conditions, see below); the
    # autoscaler flags it in status.autoscaling too.
    refused = QuotaDecision(0, False, "QuotaExceeded", "tenant team-a: the quota is 0")
    step = Service(replicas=0).step(0, demand=True, quota=refused)
    assert (step.outcome.desired, step.outcome.quota_limited) == (1, True)
    assert "tenant team-a: the quota is 0" in step.outcome.message
    status = autoscaling_status(step, previous=None, now="2030-01-01T00:00:00Z", generation=1, scaled=True)
    quota = next(c for c in status["conditions"] if c["type"] == REASON_QUOTA_LIMITED)
    assert quota["status"] == "True"


def test_demand_time_reads_rfc3339():
    assert demand_time("2030-01-01T00:00:00Z") == datetime(2030, 1, 1, tzinfo=UTC).timestamp()
    assert demand_time("2030-01-01T01:00:00+01:00") == datetime(2030, 1, 1, tzinfo=UTC).timestamp()
    assert demand_time("2030-01-01T00:00:00.250Z") == datetime(2030, 1, 1, tzinfo=UTC).timestamp() + 0.25
    for bad in (None, "", "yesterday", "2030-13-01T00:00:00Z"):
        assert demand_time(bad) is None


@pytest.mark.parametrize(
    ("age", "fresh"), [(0, True), (IDLE - 1, True), (IDLE, False), (10 * IDLE, False), (-IDLE - 1, False)]
)
def test_demand_is_fresh_within_the_idle_period(age, fresh):
    now = 1_900_000_000.0
    assert fresh_demand(now - age, now, IDLE) is fresh
    assert fresh_demand(None, now, IDLE) is False


def test_signals_from_prometheus_or_scrapes_carry_running_and_tokens():
    engine = Engine()
    engine.stats.num_running, engine.stats.prompt_tokens, engine.stats.generation_tokens = 2, 30, 12
    signals = PodScraper(60).signals(0, {"a": parse_engine_metrics(engine.text())}, {"a"})
    assert (signals.running, signals.tokens) == ({"a": 2}, {"a": 42})
    assert Signals(waiting={}, ttft_p95=None).running == {}


# ---- the quota refusing 0 -> 1, as the InferenceService's status shows it -------------------------


def test_a_quota_refusal_at_zero_shows_in_the_service_status():
    """The demand scaled spec.replicas to 1; the tenant's quota admits none: desiredReplicas stays 0, and
    the conditions the gateway reads carry the quota's message."""
    obj = {
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1", "generation": 2},
        "spec": {
            "model": {"uri": "file:///models/tiny"},
            "resources": {"gpus": 1, "gpuType": "h100"},
            "replicas": 1,
            "autoscaling": {"minReplicas": 0, "maxReplicas": 2},
        },
        "status": {},
    }
    world = World(
        config=OperatorConfig(host_path_roots=("/models",)),
        now="2030-01-01T00:00:00Z",
        gpu_types={"h100"},
        tenants={"team-a": TenantSpec(namespaces=["team-a"], gpu_quota={"h100": 0})},
        held_by_others=[],
        deployment=None,
        path_exists=lambda _p: True,
    )
    result = plan(obj, world)
    assert result.status["desiredReplicas"] == 0
    assert result.children[0]["spec"]["replicas"] == 0
    conditions = {c["type"]: c for c in result.status["conditions"]}
    quota = conditions[CONDITION_QUOTA_ADMITTED]
    assert quota["status"] == "False" and "the quota is 0" in quota["message"]
    degraded = conditions[CONDITION_DEGRADED]
    assert (degraded["status"], degraded["reason"]) == ("True", REASON_QUOTA_LIMITED)
    assert degraded["message"] == quota["message"]
    assert result.status["message"] == quota["message"]
