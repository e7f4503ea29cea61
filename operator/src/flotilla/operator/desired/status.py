"""Status: a pure function from what the operator decided and what it observes (the Deployment and the
pods) to the InferenceService's status. Failures must show here, quota failures above all: each
condition carries a reason and a message a person can act on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flotilla.contract import (
    CONDITION_DEGRADED,
    CONDITION_QUOTA_ADMITTED,
    REASON_QUOTA_LIMITED,
    engine_base_url,
)
from flotilla.operator.api.v1alpha1 import Condition, InferenceServiceStatus
from flotilla.operator.desired.validation import Problem, describe
from flotilla.operator.metrics import ServiceFigures
from flotilla.operator.tenancy.quota import QuotaDecision

# QuotaAdmitted and Degraded are the contract's: the gateway reads them (a quota refusal at zero replicas).
READY, VALID, QUOTA_ADMITTED, PROGRESSING, DEGRADED = (
    "Ready",
    "Valid",
    CONDITION_QUOTA_ADMITTED,
    "Progressing",
    CONDITION_DEGRADED,
)

# Container waiting reasons that mean the pod will not get better by itself.
_BAD_WAITING = {
    "CrashLoopBackOff",
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
}


@dataclass(frozen=True)
class PodView:
    """What status needs from one pod."""

    name: str
    ip: str | None
    ready: bool
    restarts: int
    trouble: str | None  # why the pod is unhealthy, if it is
    deleting: bool = False


def pod_view(pod: dict) -> PodView:
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = conditions.get("Ready", {}).get("status") == "True"
    restarts, trouble = 0, None
    for cs in status.get("containerStatuses") or []:
        restarts += cs.get("restartCount", 0)
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _BAD_WAITING:
            trouble = f"container {cs.get('name')}: {waiting['reason']}: {waiting.get('message', '')}".rstrip(
                ": "
            )
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if trouble is None and not cs.get("ready") and last.get("exitCode"):
            trouble = (
                f"container {cs.get('name')} exited with code {last['exitCode']} ({last.get('reason', '')})"
            )
    scheduled = conditions.get("PodScheduled", {})
    if trouble is None and scheduled.get("status") == "False":
        trouble = f"unschedulable: {scheduled.get('message') or scheduled.get('reason', '')}"
    if trouble is None and status.get("phase") == "Failed":
        trouble = f"failed: {status.get('reason') or status.get('message') or 'pod failed'}"
    return PodView(
        name=meta.get("name", ""),
        ip=status.get("podIP"),
        ready=ready,
        restarts=restarts,
        trouble=trouble,
        deleting=bool(meta.get("deletionTimestamp")),
    )


@dataclass(frozen=True)
class DeploymentView:
    generation: int
    observed_generation: int
    replicas: int
    ready: int
    updated: int
    failure: str | None  # ReplicaFailure or a missed progress deadline, e.g. a ResourceQuota refusal


def deployment_view(dep: dict) -> DeploymentView:
    status = dep.get("status") or {}
    failure = None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            failure = f"{cond.get('reason')}: {cond.get('message', '')}"
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            failure = failure or f"ProgressDeadlineExceeded: {cond.get('message', '')}"
    return DeploymentView(
        generation=dep.get("metadata", {}).get("generation", 0),
        observed_generation=status.get("observedGeneration", 0),
        replicas=status.get("replicas", 0),
        ready=status.get("readyReplicas", 0),
        updated=status.get("updatedReplicas", 0),
        failure=failure,
    )


@dataclass
class Observed:
    generation: int
    problems: list[Problem]
    quota: QuotaDecision | None  # None when the spec is invalid (quota not evaluated)
    requested_replicas: int  # what the spec asks for (clamped to autoscaling bounds)
    desired_replicas: int  # what the operator runs: requested, unless quota holds it back
    gpus_per_replica: int
    selector: str
    service_url: str | None
    deployment: DeploymentView | None
    pods: list[PodView] = field(default_factory=list)


def _cond(type_: str, ok: bool | None, reason: str, message: str) -> Condition:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return Condition(type=type_, status=status, reason=reason, message=message)


def conditions_for(o: Observed) -> list[Condition]:
    valid = not o.problems
    if valid:
        valid_c = _cond(VALID, True, "SpecValid", "the spec is valid")
    else:
        valid_c = _cond(VALID, False, o.problems[0].reason, describe(o.problems))

    if o.quota is None:
        quota_c = _cond(QUOTA_ADMITTED, None, "NotEvaluated", "quota is checked once the spec is valid")
    else:
        quota_c = _cond(QUOTA_ADMITTED, o.quota.admitted, o.quota.reason, o.quota.message)

    dep, pods = o.deployment, [p for p in o.pods if not p.deleting]
    # Readiness from the pods themselves: the Deployment's counters lag behind (the controller-manager
    # updates them at its own pace), and pods are what serves.
    ready_count = sum(1 for p in pods if p.ready)
    if not valid:
        ready_c = _cond(READY, False, "InvalidSpec", "the spec is invalid; see the Valid condition")
    elif o.desired_replicas == 0:
        ready_c = _cond(READY, False, "ScaledToZero", "no replicas are requested")
    elif ready_count >= o.desired_replicas:
        ready_c = _cond(READY, True, "ReplicasReady", f"{ready_count}/{o.desired_replicas} replicas ready")
    else:
        ready_c = _cond(
            READY, False, "ReplicasNotReady", f"{ready_count}/{o.desired_replicas} replicas ready"
        )

    if not valid:
        progressing_c = _cond(PROGRESSING, False, "InvalidSpec", "nothing is rolled out for an invalid spec")
    elif dep is None:
        progressing_c = _cond(PROGRESSING, True, "Creating", "the Deployment is being created")
    elif (
        dep.observed_generation < dep.generation
        or dep.updated < o.desired_replicas
        or dep.replicas != o.desired_replicas
        or dep.ready < o.desired_replicas
    ):
        progressing_c = _cond(
            PROGRESSING,
            True,
            "RollingOut",
            f"{dep.updated} updated, {dep.ready} ready, {dep.replicas} existing of {o.desired_replicas} desired",
        )
    else:
        progressing_c = _cond(
            PROGRESSING, False, "RolloutComplete", f"{o.desired_replicas} replicas up to date"
        )

    troubles = [f"pod {p.name}: {p.trouble}" for p in pods if p.trouble]
    if dep is not None and dep.failure:
        troubles.insert(0, f"deployment: {dep.failure}")
    if troubles:
        shown = "; ".join(troubles[:3]) + (f"; and {len(troubles) - 3} more" if len(troubles) > 3 else "")
        degraded_c = _cond(DEGRADED, True, "PodsUnhealthy", shown)
    elif o.quota is not None and o.desired_replicas < o.requested_replicas:
        degraded_c = _cond(DEGRADED, True, REASON_QUOTA_LIMITED, o.quota.message)
    else:
        degraded_c = _cond(DEGRADED, False, "Healthy", "no unhealthy pods")
    return [ready_c, valid_c, quota_c, progressing_c, degraded_c]


def merge_transition_times(
    new: list[Condition], previous: list[dict], now: str, generation: int
) -> list[Condition]:
    """Keep lastTransitionTime when a condition's status did not change, as metav1.Condition requires."""
    before = {c.get("type"): c for c in previous}
    out = []
    for cond in new:
        old = before.get(cond.type)
        unchanged = old is not None and old.get("status") == cond.status and old.get("lastTransitionTime")
        out.append(
            cond.model_copy(
                update={
                    "last_transition_time": old["lastTransitionTime"] if unchanged else now,
                    "observed_generation": generation,
                }
            )
        )
    return out


def summary_message(conditions: list[Condition]) -> str:
    """One line for `kubectl get -o wide`: the most important thing that is wrong, or that all is well."""
    by_type = {c.type: c for c in conditions}
    for type_, bad in ((VALID, "False"), (QUOTA_ADMITTED, "False"), (DEGRADED, "True")):
        cond = by_type.get(type_)
        if cond is not None and cond.status == bad:
            return cond.message
    ready = by_type.get(READY)
    return ready.message if ready else ""


def compute_status(o: Observed, previous_conditions: list[dict], now: str) -> dict:
    """The full status subresource as a wire dict."""
    conditions = merge_transition_times(conditions_for(o), previous_conditions, now, o.generation)
    live = [p for p in o.pods if not p.deleting]
    endpoints = sorted(engine_base_url(p.ip) for p in live if p.ready and p.ip)
    status = InferenceServiceStatus(
        observed_generation=o.generation,
        conditions=conditions,
        replicas=len(live),
        ready_replicas=sum(1 for p in live if p.ready),
        desired_replicas=o.desired_replicas,
        gpus=len(live) * o.gpus_per_replica,
        selector=o.selector,
        endpoints=endpoints,
        service_url=o.service_url,
        message=summary_message(conditions),
    )
    return status.model_dump(by_alias=True, mode="json")


def with_apply_failures(status: dict, failures: list[str], now: str) -> dict:
    """The API refused some children (e.g. no ClusterIP left, an admission webhook said no): say so in
    Degraded and the message instead of failing silently in the operator's log."""
    message = "the API refused: " + "; ".join(failures)
    conditions = []
    for cond in status["conditions"]:
        if cond["type"] == DEGRADED:
            was_true = cond["status"] == "True"
            cond = {**cond, "status": "True", "reason": "ApplyFailed", "message": message}
            if not was_true:
                cond["lastTransitionTime"] = now
        conditions.append(cond)
    return {**status, "conditions": conditions, "message": message}


def service_figures(spec: Mapping, status: Mapping) -> ServiceFigures:
    """What the operator's per-service series say (metrics.SERVICES), from an InferenceService's wire spec
    and the status the reconciler writes: Ready, desired and ready replicas, and the TTFT target."""
    ready = any(c.get("type") == READY and c.get("status") == "True" for c in status.get("conditions") or [])
    target = (spec.get("autoscaling") or {}).get("ttftP95TargetSeconds")
    return ServiceFigures(
        ready=ready,
        desired_replicas=int(status.get("desiredReplicas") or 0),
        ready_replicas=int(status.get("readyReplicas") or 0),
        ttft_target_seconds=float(target) if target is not None else None,
    )
