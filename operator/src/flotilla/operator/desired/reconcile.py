"""One reconcile, as a pure function: an InferenceService plus what the operator knows of the world ->
the children to apply, the status to write and the events to post. The kopf layer gathers the World from
its in-memory indexes, calls `plan`, and carries out the Plan; it decides nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from flotilla.contract import SCHEDULING_FAIR
from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.inference_pool import PoolStatus, inference_pool, pool_status
from flotilla.operator.desired.status import (
    DEGRADED,
    QUOTA_ADMITTED,
    READY,
    VALID,
    Observed,
    compute_status,
    deployment_view,
    pod_view,
)
from flotilla.operator.desired.validation import Problem, check
from flotilla.operator.desired.workload import (
    Decision,
    Owner,
    children,
    service_url,
    shared_objects,
    target_replicas,
)
from flotilla.operator.naming import NO_TENANT, selector_string
from flotilla.operator.tenancy.quota import Held, QuotaDecision, granted_replicas, used_gpus
from flotilla.operator.tenancy.rules import owner_of as owner_of_namespace
from flotilla.operator.tenancy.rules import scheduling_weights


@dataclass
class World:
    """What a reconcile may depend on besides the object itself."""

    config: OperatorConfig
    now: str  # RFC 3339; passed in so that status is a function of its inputs
    gpu_types: set[str]
    tenants: Mapping[str, TenantSpec]
    held_by_others: list[Held]  # what the other services hold
    deployment: dict | None  # the observed child Deployment
    pods: list[dict] = field(default_factory=list)
    namespace_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    path_exists: Callable[[str], bool] | None = None
    inference_pool: dict | None = None  # the observed child InferencePool
    # The Service the pools' endpointPickerRef names, as observed in the service's namespace (or None).
    picker_service: dict | None = None


@dataclass
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Plan:
    # Empty when nothing may be created (invalid spec); else the namespace's shared objects (the engine
    # token's Secret, when configured) and the service's own children, in the order to apply them.
    children: list[dict]
    status: dict
    events: list[Event]
    held: Held | None  # what this service holds once the plan is carried out
    problems: list[Problem]
    # The InferencePool's status to write (the operator's parent entry), when the observed pool lacks it.
    pool_status: PoolStatus | None = None


def owner_of(obj: dict) -> Owner:
    meta = obj["metadata"]
    return Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def plan(obj: dict, world: World) -> Plan:
    owner = owner_of(obj)
    generation = obj["metadata"].get("generation", 0)
    previous = (obj.get("status") or {}).get("conditions") or []
    # The host-path roots too: a service the webhook never saw (it was off, or bypassed) is refused here,
    # and an invalid one gets no children, so no pod ever mounts a host path of the tenant's choice.
    spec, problems = check(
        obj.get("spec") or {},
        gpu_types=world.gpu_types,
        path_exists=world.path_exists,
        host_path_roots=world.config.host_path_roots,
    )

    deployment = world.deployment
    current = (deployment or {}).get("spec", {}).get("replicas", 0) if deployment else 0
    quota: QuotaDecision | None = None
    desired_children: list[dict] = []
    held: Held | None = None
    pool_write: PoolStatus | None = None
    requested = desired = current
    gpus = 0
    if spec is not None and not problems:
        requested = target_replicas(spec)
        gpus = spec.resources.gpus
        claim = owner_of_namespace(owner.namespace, world.tenants, world.namespace_labels)
        tenant = claim.tenant
        quota = granted_replicas(
            contest=claim.contest_message() if claim.contested else None,
            tenant=tenant,
            tenant_spec=world.tenants.get(tenant) if tenant else None,
            gpu_type=spec.resources.gpu_type,
            gpus_per_replica=gpus,
            requested=requested,
            current=current,
            used_by_others=used_gpus(world.held_by_others, tenant or "", spec.resources.gpu_type),
        )
        desired = quota.replicas
        decision = Decision(
            tenant=tenant or NO_TENANT,
            replicas=desired,
            tenant_weights=scheduling_weights(world.tenants)
            if spec.engine.scheduling_policy == SCHEDULING_FAIR
            else (),
        )
        # The namespace's shared objects first: the engine pods read the token Secret when they start.
        desired_children = [
            *shared_objects(owner.namespace, world.config),
            *children(owner, spec, decision, world.config),
        ]
        if world.config.inference_pools:
            desired_children.append(inference_pool(owner, decision))
            if world.inference_pool is not None:
                pool_write = pool_status(
                    owner, world.inference_pool, world.picker_service, world.config, world.now
                )
        key = (owner.namespace, owner.name)
        held = Held(key, tenant or NO_TENANT, spec.resources.gpu_type, desired * gpus)
    elif spec is not None:
        gpus = spec.resources.gpus

    observed = Observed(
        generation=generation,
        problems=problems,
        quota=quota,
        requested_replicas=requested,
        desired_replicas=desired,
        gpus_per_replica=gpus,
        selector=selector_string(owner.name),
        service_url=service_url(owner),
        deployment=deployment_view(deployment) if deployment else None,
        pods=[pod_view(p) for p in world.pods],
    )
    status = compute_status(observed, previous, world.now)
    return Plan(
        children=desired_children,
        status=status,
        events=_events(previous, status),
        held=held,
        problems=problems,
        pool_status=pool_write,
    )


_WARN_ON = {(VALID, "False"), (QUOTA_ADMITTED, "False"), (DEGRADED, "True")}


def _events(previous: list[dict], status: dict) -> list[Event]:
    """Events for condition changes a person should hear about, once per change (not per reconcile)."""
    before = {c.get("type"): c for c in previous}
    events = []
    for cond in status["conditions"]:
        old = before.get(cond["type"], {})
        changed = old.get("status") != cond["status"] or old.get("reason") != cond["reason"]
        if not changed:
            continue
        if (cond["type"], cond["status"]) in _WARN_ON:
            events.append(Event("Warning", cond["reason"], cond["message"]))
        elif (cond["type"], cond["status"]) == (READY, "True"):
            events.append(Event("Normal", "Ready", cond["message"]))
    return events


def uses_tenant_weights(obj: dict) -> bool:
    """Whether the service's engine is rendered with the Tenants' weights (its policy is fair), so that a
    change of any Tenant's schedulingWeight must re-plan it. Read from the raw object: the kopf layer asks
    before any parsing."""
    engine = (obj.get("spec") or {}).get("engine") or {}
    return engine.get("schedulingPolicy") == SCHEDULING_FAIR


def status_changed(current: dict | None, new: dict) -> bool:
    """Whether writing `new` would change anything. Only the fields we write count (others, such as
    the autoscaler's, are kept by the merge patch), and transition times do not (merge keeps them)."""

    def strip(status: dict) -> dict:
        status = {k: status.get(k) for k in new}
        status["conditions"] = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []
        ]
        return status

    return strip(current or {}) != strip(new)
