"""Metering's kopf layer: an index of GPU pods, the spans of pods removed between rounds, and one daemon
per Tenant that, every metering interval, applies the Tenant's access objects when they changed
(tenant_access.py) and then meters (lastMeteredTime, now] into Tenant.status with one conditional PUT.
The engine pods' metering finalizer is added here as they appear and removed after the round that counted
their end (tenancy/metering.py says why); a pod that ends wakes its tenant's round.

Thin on purpose; the counting is tenancy/metering.py's.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import cast

import kopf
from kubernetes.client.exceptions import ApiException

from flotilla import timestamps
from flotilla.operator.api.v1alpha1 import (
    GROUP,
    TENANT,
    VERSION,
    Condition,
    TenantSpec,
    TenantStatus,
    TokenCount,
)
from flotilla.operator.clients.kube import MERGE
from flotilla.operator.clients.token_scrape import read_token_counters
from flotilla.operator.controllers import backstop, failpoints
from flotilla.operator.controllers.indexes import MANAGED, labels_by_namespace, tenant_specs
from flotilla.operator.controllers.state import MeteringState, Runtime
from flotilla.operator.controllers.tenant_access import sync_objects
from flotilla.operator.desired.status import merge_transition_times
from flotilla.operator.metrics import API_CALLS
from flotilla.operator.naming import (
    GPU_RESOURCE,
    GPU_TYPE_LABEL,
    METERING_FINALIZER,
    SERVICE_LABEL,
    TENANT_LABEL,
)
from flotilla.operator.tenancy.metering import (
    adapter_usage,
    cost,
    count_adapter_tokens,
    count_tokens,
    foreign_adapter_tokens,
    meter,
    metered_end,
    parse_time,
    pod_gpus,
    shared_adapter_counters,
    span_of,
    usage_views,
)
from flotilla.operator.tenancy.metering_metrics import TENANTS
from flotilla.operator.tenancy.rules import contested, namespaces_owned, owner_of, tenant_of
from flotilla.ownership import Owner

log = logging.getLogger("flotilla.operator.tenancy.rules")

WAKE_CHECK_SECONDS = 0.25  # how often a waiting daemon looks at its wake event and kopf's stop flag


def _compact_pod(body) -> dict:
    """What metering needs of a pod, and no more (indexes live in memory)."""
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), body.get("status", {})
    return {
        "metadata": {
            "uid": meta.get("uid"),
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "labels": {
                k: v for k, v in (meta.get("labels") or {}).items() if k in (SERVICE_LABEL, TENANT_LABEL)
            },
            **{k: meta[k] for k in ("deletionTimestamp", "deletionGracePeriodSeconds") if k in meta},
            "finalizers": [f for f in meta.get("finalizers") or [] if f == METERING_FINALIZER],
        },
        "spec": {
            "nodeName": spec.get("nodeName"),
            "nodeSelector": {
                k: v for k, v in (spec.get("nodeSelector") or {}).items() if k == GPU_TYPE_LABEL
            },
            "containers": [
                {
                    "resources": {
                        k: {GPU_RESOURCE: v[GPU_RESOURCE]}
                        for k, v in (c.get("resources") or {}).items()
                        if v and GPU_RESOURCE in v
                    }
                }
                for c in spec.get("containers") or []
            ],
        },
        "status": {
            "phase": status.get("phase"),
            "podIP": status.get("podIP"),
            "conditions": [
                {k: c.get(k) for k in ("type", "status", "lastTransitionTime")}
                for c in status.get("conditions") or []
                if c.get("type") in ("PodScheduled", "Ready")
            ],
            "containerStatuses": [
                {
                    "state": {
                        "terminated": {
                            "finishedAt": ((s.get("state") or {}).get("terminated") or {}).get("finishedAt")
                        }
                    }
                }
                for s in status.get("containerStatuses") or []
                if (s.get("state") or {}).get("terminated")
            ],
        },
    }


def node_gpu_types(gpu_nodes: kopf.Index) -> dict[str, str]:
    """Node name -> its GPU type, from the gpu_nodes index (GPU type -> node names)."""
    return {node: gpu_type for gpu_type, store in gpu_nodes.items() for node in store}


@kopf.on.event("", "v1", "pods", labels=MANAGED)
def hold_for_metering(body: kopf.Body, memo: kopf.Memo, **kwargs) -> None:
    """Every engine pod carries the metering finalizer while it lives; once it has ended, its tenant's
    round meters it and lets it go (at once where no tenant owns the namespace: nothing to meter)."""
    rt: Runtime = memo.runtime
    meta = body.get("metadata") or {}
    mine = METERING_FINALIZER in (meta.get("finalizers") or [])
    if meta.get("deletionTimestamp") is None:
        if not mine and (body.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            _patch_finalizers(rt, body, [*(meta.get("finalizers") or []), METERING_FINALIZER])
        return
    if not mine:
        return
    tenants = tenant_specs(kwargs["tenants"])
    owner = tenant_of(meta.get("namespace", ""), tenants, labels_by_namespace(kwargs["namespace_labels"]))
    if owner is None:
        release_pod(rt, _compact_pod(body))
        return
    state: MeteringState = memo.metering
    wake = state.wake.get(owner)
    if wake is not None:
        wake.set()


def release_pod(rt: Runtime, pod: dict) -> None:
    """Removes the metering finalizer (the pod is then deleted for good, if it was being deleted)."""
    try:
        API_CALLS.labels(verb="get", resource="pods").inc()
        current = rt.kube.core.read_namespaced_pod(pod["metadata"]["name"], pod["metadata"]["namespace"])
    except ApiException as exc:
        if exc.status == 404:
            return
        raise
    finalizers = list(current.metadata.finalizers or [])
    if METERING_FINALIZER in finalizers:
        body = {"metadata": {"name": current.metadata.name, "namespace": current.metadata.namespace,
                             "resourceVersion": current.metadata.resource_version}}  # fmt: skip
        _patch_finalizers(rt, body, [f for f in finalizers if f != METERING_FINALIZER])


def _patch_finalizers(rt: Runtime, body, finalizers: list[str]) -> None:
    """A merge patch of the whole list, conditional on the resourceVersion read (a concurrent change of
    the list by someone else fails it with 409, and the next event tries again)."""
    meta = body.get("metadata") or {}
    patch = {"metadata": {"finalizers": finalizers, "resourceVersion": meta.get("resourceVersion")}}
    API_CALLS.labels(verb="patch", resource="pods").inc()
    try:
        # A JSON merge patch replaces the list; the client's default (strategic merge) would merge it,
        # and a finalizer could never be removed.
        rt.kube.core.patch_namespaced_pod(meta.get("name"), meta.get("namespace"), patch, _content_type=MERGE)
    except ApiException as exc:
        if exc.status not in (404, 409):
            raise


@kopf.index("", "v1", "pods")
def gpu_pods(namespace: str, body: kopf.Body, **_) -> dict:
    pod = _compact_pod(body)
    return {namespace: pod} if pod_gpus(pod) else {}


@kopf.on.event("", "v1", "pods")
def pod_removed(event: dict, body: kopf.Body, memo: kopf.Memo, gpu_nodes: kopf.Index, **_) -> None:
    if event.get("type") != "DELETED":
        return
    span = span_of(_compact_pod(body), removed_at=time.time(), node_gpu_types=node_gpu_types(gpu_nodes))
    if span is not None:
        state: MeteringState = memo.metering
        with state.lock:
            state.ended[span.uid] = span


# ---------------------------------------------------------------------------------------------------
# Per Tenant


def _meter(rt: Runtime, state: MeteringState, name: str, kwargs: dict) -> None:
    """One metering round: read the Tenant, add (lastMeteredTime, now], write it back conditionally."""
    custom = rt.kube.custom
    API_CALLS.labels(verb="get", resource="tenants").inc()
    obj = cast(dict, custom.get_cluster_custom_object(GROUP, VERSION, TENANT.plural, name))
    spec = TenantSpec.model_validate(obj.get("spec") or {})
    status = TenantStatus.model_validate(obj.get("status") or {})
    labels = labels_by_namespace(kwargs["namespace_labels"])
    # The Tenant as just read, over the index's others: flotilla.ownership decides what it owns.
    tenants = {**tenant_specs(kwargs["tenants"]), name: spec}
    owned = namespaces_owned(name, tenants, labels)
    gpu_limits = backstop.limits(rt, name, spec, [ns for ns in owned if ns in labels], kwargs["gpu_pods"])
    backstop.raise_limits(rt, name, gpu_limits)  # lowered ones first, before the other objects
    sync_objects(rt.kube, state.applied, name, obj["metadata"]["uid"], spec, owned, labels, gpu_limits)
    mine = set(owned)
    disputed = [o for o in contested(tenants, labels) if name in o.claimants]

    now = time.time()
    pods = [p for ns in mine for p in kwargs["gpu_pods"].get(ns, [])]
    types = node_gpu_types(kwargs["gpu_nodes"])
    spans = {s.uid: s for s in (span_of(p, node_gpu_types=types, now=now) for p in pods) if s is not None}
    with state.lock:
        ended = {uid: s for uid, s in state.ended.items() if s.namespace in mine}
    spans.update(ended)
    ledger = meter(status.ledger, spans.values(), parse_time(status.last_metered_time), now)

    live = {p["metadata"]["uid"] for p in pods}
    counters = read_token_counters(pods)
    added, token_counters = count_tokens(ledger.token_counters, {u: c.total for u, c in counters.items()})
    # The tenant's adapters on shared base services (namespaces of a shared Tenant: Owner.shared; their GPU
    # time is that Tenant's), served there as `namespace/name`: read from those engines, counted per
    # adapter and in the tenant's tokens.
    shared_pods = [
        p for ns, store in kwargs["gpu_pods"].items() if ns not in mine and owner_of(ns, tenants, labels).shared
        for p in store
    ]  # fmt: skip
    shared = shared_adapter_counters(
        {u: c.adapters for u, c in read_token_counters(shared_pods).items()}, mine
    )
    shared_uids = {p["metadata"]["uid"] for p in shared_pods}
    added_shared, _ = count_adapter_tokens(
        {u: c for u, c in ledger.adapter_counters.items() if u in shared_uids}, shared, {}
    )
    added_by_adapter, adapter_counters = count_adapter_tokens(
        ledger.adapter_counters,
        {**{u: c.adapters for u, c in counters.items()}, **shared},
        {p["metadata"]["uid"]: p["metadata"]["namespace"] for p in [*pods, *shared_pods]},
    )
    ledger = ledger.model_copy(
        update={
            "token_counters": {uid: c for uid, c in token_counters.items() if uid in live},
            "adapter_counters": {
                uid: c for uid, c in adapter_counters.items() if (uid in live or uid in shared_uids) and c
            },
        }
    )
    # What its own engines served for other tenants' adapters (a shared Tenant's base) is theirs: out of its tokens.
    foreign = foreign_adapter_tokens(added_by_adapter, mine)
    added_in = max(0, added.input - foreign.input) + sum(t.input for t in added_shared.values())
    added_out = max(0, added.output - foreign.output) + sum(t.output for t in added_shared.values())
    tokens = TokenCount(input=status.tokens.input + added_in, output=status.tokens.output + added_out)

    allocated: dict[str, int] = {}
    for span in spans.values():
        if span.end is None:
            allocated[span.gpu_type] = allocated.get(span.gpu_type, 0) + span.gpus
    views = usage_views(ledger, now)
    total_cost = cost(views.total.by_gpu_type, spec.price_per_gpu_hour)
    served = tokens.input + tokens.output
    per_million = round(total_cost / served * 1e6, 6) if served else None
    existing = [f"{ns}/{a}" for ns in mine for a in kwargs.get("lora_adapter_names", {}).get(ns, [])]
    stamp = timestamps.from_epoch(now, micro=True)
    new_status = TenantStatus(
        gpus_allocated=allocated,
        gpu_quota=dict(spec.gpu_quota),
        services=sum(1 for key in kwargs["services"] if key[0] in mine),
        usage=views,
        tokens=tokens,
        cost=round(total_cost, 6),
        cost_per_million_tokens=per_million,
        adapters=adapter_usage(status.adapters, added_by_adapter, existing, per_million),
        ledger=ledger,
        last_metered_time=stamp,
        conditions=merge_transition_times(
            _conditions(name, spec, allocated, disputed),
            [c.to_wire() for c in status.conditions],
            stamp[:19] + "Z",
            obj["metadata"].get("generation", 0),
        ),
    )
    body = {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": {"name": name, "resourceVersion": obj["metadata"]["resourceVersion"]},
        "spec": obj.get("spec") or {},
        "status": new_status.to_wire(),
    }
    failpoints.reached("metering.counted")
    API_CALLS.labels(verb="update", resource="tenants/status").inc()
    custom.replace_cluster_custom_object_status(GROUP, VERSION, TENANT.plural, name, body)
    failpoints.reached("metering.written")
    with state.lock:
        for uid, span in ended.items():
            if state.ended.get(uid) is span:
                del state.ended[uid]
    TENANTS.update(name, new_status, spec)
    # The ledger now holds every ended pod's span to its end: their finalizers may go.
    for pod in pods:
        if pod["metadata"].get("finalizers") and metered_end(pod, now, node_gpu_types=types, now=now):
            release_pod(rt, pod)


def _conditions(
    name: str, spec: TenantSpec, allocated: dict[str, int], disputed: list[Owner]
) -> list[Condition]:
    over = {t: n for t, n in sorted(allocated.items()) if n > spec.gpu_quota.get(t, 0)}
    if over:
        detail = "; ".join(f"{n} {t} GPUs held, quota {spec.gpu_quota.get(t, 0)}" for t, n in over.items())
        limited = Condition(
            type="QuotaLimited",
            status="True",
            reason="OverQuota",
            message=f"tenant {name}: {detail}; running pods are kept, scale-up is refused until use falls",
        )
    else:
        limited = Condition(
            type="QuotaLimited", status="False", reason="WithinQuota", message=f"tenant {name}: within quota"
        )
    metered = Condition(type="Metered", status="True", reason="Metered", message="GPU time metered")
    if disputed:
        claim = Condition(
            type="NamespacesContested",
            status="True",
            reason="ClaimedByAnotherTenant",
            message="; ".join(o.contest_message() for o in disputed)[:1000],
        )
    else:
        claim = Condition(
            type="NamespacesContested",
            status="False",
            reason="SoleOwner",
            message=f"tenant {name}: no other Tenant claims its namespaces",
        )
    return [metered, limited, claim]


def _seed(name: str, kwargs: dict) -> None:
    """The Tenant's series from its stored status until the first round writes: after a restart, a Tenant
    whose metering keeps failing still shows its last lastMeteredTime, so the staleness alert fires."""
    try:
        status = TenantStatus.model_validate(dict(kwargs.get("status") or {}))
        spec = TenantSpec.model_validate(dict(kwargs.get("spec") or {}))
    except ValueError as exc:
        log.info("tenant %s: stored status not exported until metering writes: %s", name, exc)
        return
    TENANTS.update(name, status, spec)


@kopf.daemon(GROUP, VERSION, TENANT.plural, cancellation_timeout=10)
def meter_tenant(stopped: kopf.DaemonStopped, name: str, memo: kopf.Memo, **kwargs) -> None:
    rt: Runtime = memo.runtime
    state: MeteringState = memo.metering
    _seed(name, kwargs)
    wake = state.wake.setdefault(name, threading.Event())
    while not stopped:
        wake.clear()
        try:
            _meter(rt, state, name, kwargs)
        except ApiException as exc:
            if exc.status == 409:  # the Tenant changed since we read it: the next round covers this one
                log.info("tenant %s: metering round skipped (conflict)", name)
            elif exc.status == 404:
                TENANTS.forget(name)
                return
            else:
                log.warning("tenant %s: metering round failed: %s", name, exc)
        except Exception as exc:  # one bad round must not end metering for good
            log.warning("tenant %s: metering round failed: %s", name, exc, exc_info=exc)
        deadline = time.monotonic() + rt.tenancy.metering_interval_seconds
        while not stopped and not wake.is_set() and time.monotonic() < deadline:
            stopped.wait(min(WAKE_CHECK_SECONDS, max(0.0, deadline - time.monotonic())))
    state.applied.pop(name, None)
