"""From an engine's real /metrics text to a decision and status.autoscaling, without a cluster."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest

from flotilla.engine.core.outputs import EngineStats
from flotilla.engine.server.metrics import EngineMetrics
from flotilla.operator.api.v1alpha1 import Autoscaling
from flotilla.operator.autoscaling.autoscaler import (
    ServiceAutoscaler,
    autoscaling_status,
    metrics_source,
    scraped_pods,
)
from flotilla.operator.clients.engine_metrics import PodScraper, ScrapeError, parse_engine_metrics
from flotilla.operator.desired.status import PodView
from flotilla.operator.tenancy.quota import QuotaDecision


class FakeEngine:
    """The engine's own metrics code, fed by hand: the exposition format is the exporter's, not ours."""

    def __init__(self) -> None:
        self.stats = EngineStats()
        self.metrics = EngineMetrics("tiny", lambda: self.stats)

    def serve(self, ttfts=(), waiting=0, kv=0.0) -> str:
        for t in ttfts:
            self.metrics.ttft.observe(t)
        self.stats.num_waiting, self.stats.kv_cache_usage = waiting, kv
        return generate_latest(self.metrics.registry).decode()


def test_parse_reads_the_engine_exporter():
    engine = FakeEngine()
    sample = parse_engine_metrics(engine.serve(ttfts=[0.02, 0.3, 0.3], waiting=7, kv=0.25))
    assert (sample.waiting, sample.kv_usage) == (7, 0.25)
    buckets = dict(sample.ttft_buckets)
    assert buckets[0.025] == 1 and buckets[0.3] == 3 and buckets[math.inf] == 3


def test_parse_rejects_what_is_not_an_engine():
    with pytest.raises(ScrapeError, match="flotilla_num_requests_waiting is missing"):
        parse_engine_metrics("# HELP x y\n# TYPE x gauge\nx 1\n")
    with pytest.raises(ScrapeError, match="unparseable"):
        parse_engine_metrics("this is { not metrics\n")


def spec(**kw) -> Autoscaling:
    return Autoscaling.model_validate(
        {"minReplicas": 1, "maxReplicas": 4, "ttftP95TargetSeconds": 0.5, "queueDepthTarget": 2} | kw
    )


def pod(name, ready=True, ip="127.0.0.9", deleting=False):
    return PodView(name=name, ip=ip, ready=ready, restarts=0, trouble=None, deleting=deleting)


def test_scraped_pods_are_the_ready_live_ones():
    views = [pod("a"), pod("b", ready=False), pod("c", ip=None), pod("d", deleting=True)]
    assert scraped_pods(views) == {"a": "127.0.0.9"}


def test_steps_from_scrapes_to_status():
    engine, scraper, scaler = FakeEngine(), PodScraper(30), ServiceAutoscaler()
    signals = scraper.signals(0, {"a": parse_engine_metrics(engine.serve())}, {"a"})
    first = scaler.step(now=0, spec=spec(), current=1, pods=[pod("a")], signals=signals, quota=None)
    assert (first.outcome.desired, first.outcome.limited_by) == (1, "MinReplicas")  # idle: 0, kept at min
    assert first.metrics.ttft_p95_seconds is None  # a baseline: no requests in the window yet

    signals = scraper.signals(
        5, {"a": parse_engine_metrics(engine.serve(ttfts=[1.2] * 20, waiting=6))}, {"a"}
    )
    step = scaler.step(now=5, spec=spec(), current=1, pods=[pod("a")], signals=signals, quota=None)
    assert step.metrics.ttft_p95_seconds == pytest.approx(1.475)  # 95% into the (1.0, 1.5] bucket
    assert step.metrics.queue_depth_per_replica == 6
    assert step.outcome.proposals == {"queueDepth": 3, "ttftP95": 3}
    assert step.outcome.desired == 3

    status = autoscaling_status(step, previous=None, now="2030-01-01T00:00:00Z", generation=2, scaled=True)
    assert status["desiredReplicas"] == 3 and status["lastScaleTime"] == "2030-01-01T00:00:00Z"
    assert status["currentMetrics"]["ttftP95Seconds"] == pytest.approx(1.475)
    conds = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conds == {
        "ScalingActive": ("True", "ValidMetrics"),
        "ScalingLimited": ("False", "DesiredWithinRange"),
        "QuotaLimited": ("False", "WithinQuota"),
        "MetricsFallback": ("False", "EngineScrape"),
    }
    down = metrics_source("http://prom:9090", "Prometheus at http://prom:9090: ConnectError: refused")
    fell = autoscaling_status(step, previous=status, now="2030-01-01T00:00:05Z", generation=2, scaled=False,
                              source=down)  # fmt: skip
    (cond,) = [c for c in fell["conditions"] if c["type"] == "MetricsFallback"]
    assert (cond["status"], cond["reason"]) == ("True", "PrometheusUnavailable")
    assert "ConnectError" in cond["message"] and "scraped directly" in cond["message"]


def test_quota_decision_caps_and_sets_the_condition():
    engine, scaler = FakeEngine(), ServiceAutoscaler()
    refused = QuotaDecision(2, False, "QuotaExceeded", "tenant team-a: the quota is 2")
    step = scaler.step(
        now=0,
        spec=spec(),
        current=1,
        pods=[pod("a")],
        signals=PodScraper(30).signals(0, {"a": parse_engine_metrics(engine.serve(waiting=20))}, {"a"}),
        quota=refused,
    )
    assert (step.outcome.desired, step.outcome.quota_limited) == (2, True)
    status = autoscaling_status(step, previous=None, now="2030-01-01T00:00:00Z", generation=1, scaled=True)
    quota = next(c for c in status["conditions"] if c["type"] == "QuotaLimited")
    assert quota["status"] == "True" and "tenant team-a: the quota is 2" in quota["message"]


def test_all_scrapes_failing_holds_and_keeps_the_old_scale_time():
    scaler = ServiceAutoscaler()
    failed = {n: ScrapeError("refused") for n in "abc"}
    step = scaler.step(
        now=0,
        spec=spec(),
        current=3,
        pods=[pod("a"), pod("b"), pod("c")],
        signals=PodScraper(30).signals(0, failed, set("abc")),
        quota=None,
    )
    assert (step.outcome.desired, step.outcome.reason) == (3, "NoMetrics")
    assert step.metrics.pods_unanswered == 3 and step.metrics.queue_depth_per_replica is None
    previous = {"lastScaleTime": "2029-01-01T00:00:00Z", "conditions": []}
    status = autoscaling_status(
        step, previous=previous, now="2030-01-01T00:00:00Z", generation=1, scaled=False
    )
    assert status["lastScaleTime"] == "2029-01-01T00:00:00Z"
    assert status["currentMetrics"]["ttftP95Seconds"] is None  # a null, so the merge patch clears it
    active = next(c for c in status["conditions"] if c["type"] == "ScalingActive")
    assert (active["status"], active["reason"]) == ("False", "NoMetrics")
