"""One service's autoscaler between decisions, and the glue from observations to the rule and back.

No I/O here: controllers/autoscaling.py gets the Signals from a metrics source (pod scrapes or Prometheus),
calls `step`, and writes what it returns (the scale, status.autoscaling, an Event, gauges). The state
kept between decisions (the recommendation history, and the scraper's TTFT window) lives in memory, so
an operator restart starts it afresh: the scale-down window then begins again, which errs on the side
of keeping replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flotilla.contract import REASON_QUOTA_LIMITED
from flotilla.operator.api.v1alpha1 import Autoscaling, AutoscalingMetrics, AutoscalingStatus, Condition
from flotilla.operator.autoscaling.rule import (
    Inputs,
    Outcome,
    PodSample,
    Policy,
    Recommendation,
    scale_target,
)
from flotilla.operator.autoscaling.scale_to_zero import IdleClock, activity
from flotilla.operator.autoscaling.signals import Signals
from flotilla.operator.desired.status import PodView, merge_transition_times
from flotilla.operator.tenancy.quota import QuotaDecision

# status.autoscaling's condition types; the quota's is named like the reason the InferenceService's own
# Degraded condition gives (flotilla.contract.REASON_QUOTA_LIMITED).
SCALING_ACTIVE, SCALING_LIMITED, QUOTA_LIMITED = "ScalingActive", "ScalingLimited", REASON_QUOTA_LIMITED
METRICS_FALLBACK = "MetricsFallback"  # True while Prometheus is down and the engines are scraped instead


def policy_for(spec: Autoscaling) -> Policy:
    return Policy(
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        ttft_p95_target=spec.ttft_p95_target_seconds,
        queue_depth_target=spec.queue_depth_target,
        tolerance=spec.tolerance,
        scale_up_window=spec.scale_up_window_seconds,
        scale_down_window=spec.scale_down_window_seconds,
        scale_to_zero_after=spec.scale_to_zero_after_seconds if spec.min_replicas == 0 else None,
    )


def scraped_pods(pods: list[PodView]) -> dict[str, str]:
    """Pods worth scraping: ready, with an address, not on their way out (name -> IP)."""
    return {p.name: p.ip for p in pods if p.ready and p.ip and not p.deleting}


@dataclass
class Step:
    outcome: Outcome
    metrics: AutoscalingMetrics
    errors: dict[str, str]  # pod -> why it did not report


@dataclass
class ServiceAutoscaler:
    """The recommendation history and the idle clock between decisions (the metrics source keeps its own
    state)."""

    history: tuple[Recommendation, ...] = ()
    idle: IdleClock = field(default_factory=IdleClock)

    def step(
        self,
        *,
        now: float,
        spec: Autoscaling,
        current: int,
        pods: list[PodView],
        signals: Signals,
        quota: QuotaDecision | None,
        demand: bool = False,
    ) -> Step:
        """`quota` is the tenant's answer to "may this service run maxReplicas?" (at zero replicas: "may it
        run one?"; None: no tenant). `demand`: a fresh demand annotation (scale_to_zero.fresh_demand)."""
        live = [p for p in pods if not p.deleting]
        samples = [PodSample(p.name, p.ready, signals.waiting.get(p.name)) for p in live]
        ready = [s for s in samples if s.ready]
        answered = [s.waiting for s in ready if s.waiting is not None]
        self.idle.forget({p.name for p in live})
        seen = activity(
            [s.name for s in ready], signals.waiting, signals.running, signals.tokens, bool(signals.errors)
        )
        idle_for = self.idle.observe(now, current, seen)
        inputs = Inputs(
            now=now,
            current=current,
            pods=samples,
            ttft_p95=signals.ttft_p95,
            ttft_complete=not signals.errors and len(answered) == len(ready),
            policy=policy_for(spec),
            history=self.history,
            quota_max=None if quota is None or quota.admitted else quota.replicas,
            quota_message="" if quota is None else quota.message,
            idle_for=idle_for,
            demand=demand,
        )
        outcome = scale_target(inputs)
        self.history = outcome.history
        metrics = AutoscalingMetrics(
            ttft_p95_seconds=signals.ttft_p95,
            queue_depth_per_replica=sum(answered) / len(answered) if answered else None,
            kv_cache_usage_ratio=signals.kv_usage,
            ready_pods=len(ready),
            pods_scraped=len(signals.waiting),
            pods_unanswered=len(signals.errors),
        )
        return Step(outcome, metrics, dict(signals.errors))


def _cond(type_: str, ok: bool, reason: str, message: str) -> Condition:
    return Condition(type=type_, status="True" if ok else "False", reason=reason, message=message)


@dataclass(frozen=True)
class MetricsSource:
    """Where this decision's signals came from, for the MetricsFallback condition."""

    fallback: bool
    reason: str
    message: str


def metrics_source(prometheus_url: str | None, unavailable: str | None) -> MetricsSource:
    if unavailable is not None:
        return MetricsSource(
            True,
            "PrometheusUnavailable",
            f"{unavailable}; the engines' /metrics are scraped directly until Prometheus answers again",
        )
    if prometheus_url:
        return MetricsSource(False, "Prometheus", f"signals are read from Prometheus at {prometheus_url}")
    return MetricsSource(False, "EngineScrape", "signals are scraped from the engines' /metrics")


def autoscaling_status(
    step: Step,
    *,
    previous: dict | None,
    now: str,
    generation: int,
    scaled: bool,
    source: MetricsSource | None = None,
) -> dict:
    """status.autoscaling as a wire dict; conditions keep their transition times while unchanged. Unset
    figures stay as nulls: in a merge patch they delete the old value instead of leaving it stale."""
    previous = previous or {}
    outcome = step.outcome
    active = _cond(
        SCALING_ACTIVE,
        outcome.active,
        "ValidMetrics" if outcome.active else outcome.reason or "NoMetrics",
        "the replica count is computed from engine metrics" if outcome.active else outcome.message,
    )
    bounded = outcome.limited_by in ("MinReplicas", "MaxReplicas", "ScaleUpLimit")
    limited = _cond(
        SCALING_LIMITED,
        bounded,
        outcome.limited_by if bounded else "DesiredWithinRange",
        outcome.message if bounded else "the desired count is within the bounds and step limits",
    )
    quota = _cond(
        QUOTA_LIMITED,
        outcome.quota_limited,
        REASON_QUOTA_LIMITED if outcome.quota_limited else "WithinQuota",
        outcome.message if outcome.quota_limited else "the tenant's quota does not limit scaling",
    )
    source = source or metrics_source(None, None)
    fallback = _cond(METRICS_FALLBACK, source.fallback, source.reason, source.message)
    conditions = merge_transition_times(
        [active, limited, quota, fallback], previous.get("conditions") or [], now, generation
    )
    status = AutoscalingStatus(
        current_metrics=step.metrics,
        recommendation=outcome.recommendation,
        desired_replicas=outcome.desired,
        last_scale_time=now if scaled else previous.get("lastScaleTime"),
        last_decision_time=now,
        reason=outcome.reason,
        message=outcome.message,
        conditions=conditions,
    )
    return status.model_dump(by_alias=True, mode="json")
