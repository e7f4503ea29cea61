"""One service's autoscaler between decisions, and the glue from observations to the rule and back.

No I/O here: autoscale_handlers.py scrapes the pods, calls `step`, and writes what it returns (the
scale, status.autoscaling, an Event, gauges). The state kept between decisions is the TTFT histogram
window and the recommendation history; both live in memory, so an operator restart starts them afresh
(the scale-down window then begins again, which errs on the side of keeping replicas).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flotilla.operator.api import Autoscaling, AutoscalingMetrics, AutoscalingStatus, Condition
from flotilla.operator.autoscale_rule import Inputs, Outcome, PodSample, Policy, Recommendation, decide
from flotilla.operator.engine_metrics_scrape import EngineSample, ScrapeError
from flotilla.operator.histogram_window import WindowedHistogram
from flotilla.operator.quota import QuotaDecision
from flotilla.operator.status import PodView, merge_transition_times

SCALING_ACTIVE, SCALING_LIMITED, QUOTA_LIMITED = "ScalingActive", "ScalingLimited", "QuotaLimited"


def policy_for(spec: Autoscaling) -> Policy:
    return Policy(
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        ttft_p95_target=spec.ttft_p95_target_seconds,
        queue_depth_target=spec.queue_depth_target,
        tolerance=spec.tolerance,
        scale_up_window=spec.scale_up_window_seconds,
        scale_down_window=spec.scale_down_window_seconds,
    )


def scraped_pods(pods: list[PodView]) -> dict[str, str]:
    """Pods worth scraping: ready, with an address, not on their way out (name -> IP)."""
    return {p.name: p.ip for p in pods if p.ready and p.ip and not p.deleting}


@dataclass
class Step:
    outcome: Outcome
    metrics: AutoscalingMetrics
    errors: dict[str, str]  # pod -> why its scrape failed


@dataclass
class ServiceAutoscaler:
    ttft_window: float
    window: WindowedHistogram = field(init=False)
    history: tuple[Recommendation, ...] = ()

    def __post_init__(self) -> None:
        self.window = WindowedHistogram(self.ttft_window)

    def step(
        self,
        *,
        now: float,
        spec: Autoscaling,
        current: int,
        pods: list[PodView],
        scraped: dict[str, EngineSample | ScrapeError],
        quota: QuotaDecision | None,
    ) -> Step:
        """`quota` is the tenant's answer to "may this service run maxReplicas?" (None: no tenant)."""
        if spec.ttft_window_seconds != self.window.window:
            self.window.window = spec.ttft_window_seconds
        live = [p for p in pods if not p.deleting]
        ok = {n: s for n, s in scraped.items() if isinstance(s, EngineSample)}
        errors = {n: str(s) for n, s in scraped.items() if isinstance(s, ScrapeError)}
        self.window.observe(now, {n: s.ttft_buckets for n, s in ok.items() if s.ttft_buckets})
        self.window.forget({p.name for p in live})

        samples = [PodSample(p.name, p.ready, ok[p.name].waiting if p.name in ok else None) for p in live]
        ready = [s for s in samples if s.ready]
        answered = [s.waiting for s in ready if s.waiting is not None]
        inputs = Inputs(
            now=now,
            current=current,
            pods=samples,
            ttft_p95=self.window.quantile(0.95),
            ttft_complete=not errors and len(answered) == len(ready),
            policy=policy_for(spec),
            history=self.history,
            quota_max=None if quota is None or quota.admitted else quota.replicas,
            quota_message="" if quota is None else quota.message,
        )
        outcome = decide(inputs)
        self.history = outcome.history
        kv = [ok[n].kv_usage for n in ok if ok[n].kv_usage is not None]
        metrics = AutoscalingMetrics(
            ttft_p95_seconds=inputs.ttft_p95,
            queue_depth_per_replica=sum(answered) / len(answered) if answered else None,
            kv_cache_usage_ratio=max(kv) if kv else None,
            ready_pods=len(ready),
            pods_scraped=len(ok),
            pods_unanswered=len(errors),
        )
        return Step(outcome, metrics, errors)


def _cond(type_: str, ok: bool, reason: str, message: str) -> Condition:
    return Condition(type=type_, status="True" if ok else "False", reason=reason, message=message)


def autoscaling_status(step: Step, *, previous: dict | None, now: str, generation: int, scaled: bool) -> dict:
    """status.autoscaling as a wire dict; conditions keep their transition times while unchanged. Unset
    figures stay as nulls: in a merge patch they delete the old value instead of leaving it stale."""
    previous = previous or {}
    outcome = step.outcome
    active = _cond(
        SCALING_ACTIVE,
        outcome.active,
        "ValidMetrics" if outcome.active else "NoMetrics",
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
        "QuotaLimited" if outcome.quota_limited else "WithinQuota",
        outcome.message if outcome.quota_limited else "the tenant's quota does not limit scaling",
    )
    conditions = merge_transition_times(
        [active, limited, quota], previous.get("conditions") or [], now, generation
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
