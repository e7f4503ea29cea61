"""The autoscaling decision: a pure function from what was measured to the replicas to run.

It follows the Kubernetes HPA's algorithm (replica_calculator.go, horizontal.go), signal by signal:
- queue depth is a load, `AverageValue` semantics: ceil(waiting per ready pod / target x ready pods);
- TTFT p95 is a latency, `Value` semantics: ceil(ready pods x p95 / target);
- each signal ignores changes within the tolerance; the largest proposal wins;
- stabilization: scale-up takes the lowest, scale-down the highest recommendation within its window;
- scale-up is limited per decision to max(factor x current, current + pods);
- then minReplicas/maxReplicas, then the tenant's quota (which never removes running replicas).

This rule never recommends zero replicas: with minReplicas 0 it keeps at least one. Only the scale-to-zero
rule (scale_to_zero.py) goes to zero, after an idle period, and only a demand comes back from zero: a
service at zero has no pods, so no metric could ever ask for one.

Missing metrics and pods that are not ready follow HPA's conservative rules: a pod that did not answer
counts as exactly on target when the others say "scale down" and as idle when they say "scale up"; a
pod that is not ready counts as idle on scale-up and is ignored otherwise; with no metrics at all the
replicas are held (only the min/max bounds apply). A failed scrape can therefore never shrink a service.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flotilla.contract import REASON_QUOTA_LIMITED
from flotilla.operator.autoscaling.scale_to_zero import AT_ZERO, DEMAND, IDLE

QUEUE, TTFT = "queueDepth", "ttftP95"


@dataclass(frozen=True)
class PodSample:
    """One engine pod as this decision saw it. `waiting` is None when its scrape failed."""

    name: str
    ready: bool
    waiting: float | None


@dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    ttft_p95_target: float | None = None  # seconds
    queue_depth_target: float | None = None  # waiting requests per ready replica
    tolerance: float = 0.1
    scale_up_window: float = 0.0  # seconds
    scale_down_window: float = 300.0
    scale_up_max_factor: float = 2.0  # per decision: at most double ...
    scale_up_max_pods: int = 4  # ... or add 4, whichever is more
    scale_to_zero_after: float | None = None  # seconds idle before zero; None unless minReplicas is 0


@dataclass(frozen=True)
class Recommendation:
    time: float
    replicas: int


@dataclass(frozen=True)
class Inputs:
    now: float  # seconds, any monotonic origin shared with the history
    current: int  # the scale target's spec.replicas
    pods: list[PodSample]
    ttft_p95: float | None  # over the window, from the pods that answered; None when no request finished
    ttft_complete: bool  # every ready pod answered, so a low p95 may justify scaling down
    policy: Policy
    history: tuple[Recommendation, ...] = ()
    quota_max: int | None = None  # most replicas the tenant's quota admits; None when no quota applies
    quota_message: str = ""
    idle_for: float | None = None  # seconds the service has been idle; None when this round cannot tell
    demand: bool = False  # a fresh demand annotation (scale_to_zero.fresh_demand)


@dataclass(frozen=True)
class Outcome:
    desired: int
    recommendation: int | None  # the raw recommendation this decision added to the history
    proposals: dict[str, int] = field(default_factory=dict)
    reason: str = ""  # CamelCase, for status and events
    message: str = ""
    limited_by: str | None = None  # MinReplicas | MaxReplicas | ScaleUpLimit | QuotaLimited
    quota_limited: bool = False
    history: tuple[Recommendation, ...] = ()

    @property
    def active(self) -> bool:
        """Whether any metric drove this decision (HPA's ScalingActive)."""
        return self.recommendation is not None


def queue_proposal(pods: list[PodSample], target: float, current: int, tolerance: float) -> int | None:
    """HPA's AverageValue calculation with its missing-metric and unready-pod rules."""
    measured = [p.waiting for p in pods if p.ready and p.waiting is not None]
    if not measured:
        return None
    missing = sum(1 for p in pods if p.ready and p.waiting is None)
    unready = sum(1 for p in pods if not p.ready)
    ratio = sum(measured) / len(measured) / target
    scale_up_with_unready = unready > 0 and ratio > 1.0
    if not missing and not scale_up_with_unready:
        if abs(ratio - 1.0) <= tolerance:
            return current
        return math.ceil(ratio * len(measured))

    values = list(measured)
    # Missing pods: on target when scaling down (so they hold it back), idle when scaling up.
    values += [target if ratio < 1.0 else 0.0] * missing
    if scale_up_with_unready:
        values += [0.0] * unready  # pods still starting will take load soon
    new_ratio = sum(values) / len(values) / target
    flipped = (ratio < 1.0 < new_ratio) or (ratio > 1.0 > new_ratio)
    if abs(new_ratio - 1.0) <= tolerance or flipped:
        return current
    proposal = math.ceil(new_ratio * len(values))
    if (new_ratio < 1.0 and proposal > current) or (new_ratio > 1.0 and proposal < current):
        return current
    return proposal


def ttft_proposal(
    p95: float | None, target: float, ready: int, current: int, complete: bool, tolerance: float
) -> int | None:
    """Value semantics: the latency scales with the replicas that serve it now (the ready ones)."""
    if p95 is None:
        return None
    ratio = p95 / target
    if abs(ratio - 1.0) <= tolerance or ready == 0:
        return current
    if ratio < 1.0 and not complete:
        return current  # a pod we did not hear from may be the slow one
    proposal = math.ceil(ready * ratio)
    if (ratio < 1.0 and proposal > current) or (ratio > 1.0 and proposal < current):
        return current
    return proposal


def stabilize(
    recommendation: int, current: int, history: tuple[Recommendation, ...], now: float, policy: Policy
) -> int:
    """Up: the lowest recommendation in the up window; down: the highest in the down window."""
    up, down = recommendation, recommendation
    for rec in history:
        if rec.time > now - policy.scale_up_window:
            up = min(up, rec.replicas)
        if rec.time > now - policy.scale_down_window:
            down = max(down, rec.replicas)
    stabilized = max(current, up)
    return min(stabilized, down)


def _prune(history: tuple[Recommendation, ...], now: float, policy: Policy) -> tuple[Recommendation, ...]:
    keep = max(policy.scale_up_window, policy.scale_down_window)
    return tuple(r for r in history if r.time > now - keep)


def _clamp(inputs: Inputs, wanted: int) -> tuple[int, str | None, bool]:
    """Step limit, bounds, then quota. Returns (replicas, what limited them, whether quota did). A running
    service keeps at least one replica whatever minReplicas says: only the idle rule goes to zero."""
    policy, current = inputs.policy, inputs.current
    desired, limited_by = wanted, None
    step_limit = max(math.ceil(current * policy.scale_up_max_factor), current + policy.scale_up_max_pods)
    if desired > step_limit:
        desired, limited_by = step_limit, "ScaleUpLimit"
    if desired > policy.max_replicas:
        desired, limited_by = policy.max_replicas, "MaxReplicas"
    if desired < policy.min_replicas:
        desired, limited_by = policy.min_replicas, "MinReplicas"
    if desired < 1 <= current:
        desired = 1
    if inputs.quota_max is not None:
        allowed = max(current, inputs.quota_max)  # quota refuses growth; it never removes what runs
        if desired > allowed:
            return allowed, REASON_QUOTA_LIMITED, True
    return desired, limited_by, False


def _describe(inputs: Inputs, proposals: dict[str, int]) -> str:
    policy, parts = inputs.policy, []
    if QUEUE in proposals:
        ready = [p for p in inputs.pods if p.ready and p.waiting is not None]
        per_pod = sum(p.waiting or 0.0 for p in ready) / len(ready)
        parts.append(
            f"queue {per_pod:.2f}/replica (target {policy.queue_depth_target:g}) -> {proposals[QUEUE]}"
        )
    if TTFT in proposals:
        parts.append(
            f"ttft p95 {inputs.ttft_p95:.3f}s (target {policy.ttft_p95_target:g}s) -> {proposals[TTFT]}"
        )
    return "; ".join(parts)


def _zero(inputs: Inputs) -> Outcome | None:
    """The scale-to-zero rule, for a service whose minReplicas is 0: from zero only on demand, to zero only
    after the idle period. None leaves the decision to the metrics rule."""
    policy, current = inputs.policy, inputs.current
    after = policy.scale_to_zero_after
    if after is None or policy.min_replicas > 0:
        return None
    history = _prune(inputs.history, inputs.now, policy)
    if current == 0 and inputs.demand:
        # One replica, even when the tenant's quota cannot admit it: the reconciler holds it back then and
        # says why in the InferenceService's QuotaAdmitted and Degraded conditions, which the gateway relays.
        refused = inputs.quota_max is not None and inputs.quota_max < 1
        message = "a request is waiting (demand annotation); 0 -> 1 replicas"
        if refused:
            message += f"; the tenant's quota does not admit it ({inputs.quota_message})"
        return Outcome(
            desired=1,
            recommendation=None,
            reason=DEMAND,
            message=message,
            limited_by=REASON_QUOTA_LIMITED if refused else None,
            quota_limited=refused,
            history=history,
        )
    if current == 0:
        return Outcome(
            desired=0,
            recommendation=None,
            reason=AT_ZERO,
            message="scaled to zero; a demand (a request waiting at the gateway) brings one replica",
            history=history,
        )
    if inputs.idle_for is not None and inputs.idle_for >= after and not inputs.demand:
        return Outcome(
            desired=0,
            recommendation=None,
            reason=IDLE,
            message=f"idle for {inputs.idle_for:.0f}s (no request running or waiting, no token served, "
            f"no demand; scaleToZeroAfterSeconds {after:g}); {current} -> 0 replicas",
            history=(),
        )
    return None


def scale_target(inputs: Inputs) -> Outcome:
    """The replicas the service should run now, and why: to or from zero (idle, a demand), else the
    largest of the signals' proposals, stabilized and kept within the bounds and the tenant's quota."""
    zero = _zero(inputs)
    if zero is not None:
        return zero
    policy, current = inputs.policy, inputs.current
    ready = sum(1 for p in inputs.pods if p.ready)
    proposals: dict[str, int] = {}
    if policy.queue_depth_target is not None:
        proposal = queue_proposal(inputs.pods, policy.queue_depth_target, current, policy.tolerance)
        if proposal is not None:
            proposals[QUEUE] = proposal
    if policy.ttft_p95_target is not None:
        proposal = ttft_proposal(
            inputs.ttft_p95, policy.ttft_p95_target, ready, current, inputs.ttft_complete, policy.tolerance
        )
        if proposal is not None:
            proposals[TTFT] = proposal

    if not proposals:
        # HPA: with no metrics, do nothing but keep the bounds. Quota may refuse a raise to minReplicas.
        desired, limited_by, quota_limited = _clamp(inputs, current)
        ready_pods = [p for p in inputs.pods if p.ready]
        silent = sum(1 for p in ready_pods if p.waiting is None)
        message = (
            f"no metrics ({len(inputs.pods)} pods, {len(ready_pods)} ready, {silent} of those did not answer); "
            f"holding {current} replicas"
        )
        if desired != current:
            message += f", moved to {desired} by {limited_by}"
        return Outcome(
            desired=desired,
            recommendation=None,
            reason="NoMetrics",
            message=message,
            limited_by=limited_by,
            quota_limited=quota_limited,
            history=_prune(inputs.history, inputs.now, policy),
        )

    recommendation = max(proposals.values())
    stabilized = stabilize(recommendation, current, inputs.history, inputs.now, policy)
    desired, limited_by, quota_limited = _clamp(inputs, stabilized)
    history = _prune(inputs.history, inputs.now, policy) + (Recommendation(inputs.now, recommendation),)

    if desired > current:
        reason = "ScaleUp"
    elif desired < current:
        reason = "ScaleDown"
    elif stabilized != recommendation:
        reason = "Stabilized"
    else:
        reason = "Steady"
    message = f"{_describe(inputs, proposals)}; recommended {recommendation}"
    if stabilized != recommendation:
        message += f", stabilized to {stabilized}"
    if limited_by is not None:
        message += f", limited by {limited_by}"
        if quota_limited and inputs.quota_message:
            message += f" ({inputs.quota_message})"
    message += f"; {current} -> {desired} replicas"
    return Outcome(
        desired=desired,
        recommendation=recommendation,
        proposals=proposals,
        reason=reason,
        message=message,
        limited_by=limited_by,
        quota_limited=quota_limited,
        history=history,
    )
