"""The admission webhook's quota review of an InferenceService: what a service is charged, and whether
its tenant may hold that (`review`). Pure; the webhook (controllers/webhook_reviews.py) asks it after the
spec's own validation. The counting (what is held, what is in use, what fits) is quota.py's.

What a service is charged at admission (`charge`):
- a fixed service: replicas x gpus;
- an autoscaled service: maxReplicas x gpus. Admission is the only place a tenant hears a plain "no"
  while applying. Charging minReplicas would admit services whose autoscalers then compete for the
  same GPUs at runtime, and the loser's latency target silently breaks exactly when load is high
  (the problem LLMKube #1338 shows). Charging the maximum means every admitted service can always
  reach its maxReplicas; the runtime clamp (quota.granted_replicas) stays as the backstop for quotas lowered later.

Updates that do not raise a service's charge are always admitted, so a lowered quota never blocks
edits, the operator's own annotation writes, or scaling down.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flotilla.operator.api.v1alpha1 import InferenceServiceSpec, TenantSpec
from flotilla.operator.tenancy.quota import Headroom, Held, Key, limit_of, used_gpus


@dataclass(frozen=True)
class Charge:
    gpu_type: str | None
    gpus: int
    how: str  # "3 replicas x 2 h100 GPUs", for messages


def charge(spec: InferenceServiceSpec) -> Charge:
    gpus = spec.resources.gpus
    gpu_type = spec.resources.gpu_type
    if spec.autoscaling is not None:
        replicas, what = spec.autoscaling.max_replicas, "maxReplicas"
    else:
        replicas, what = spec.replicas, "replicas"
    return Charge(
        gpu_type, replicas * gpus, f"{what} {replicas} x {gpus} {gpu_type or ''} GPUs".replace("  ", " ")
    )


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    message: str
    reason: str
    code: int = 403  # the HTTP status of a refusal: 403 for quota, 422 for a spec that is invalid


def review(
    *,
    key: Key,
    tenant: str | None,
    tenant_spec: TenantSpec | None,
    new: Charge,
    old: Charge | None,
    others: Iterable[Held],
    contest: str | None = None,
) -> Verdict:
    """Whether the tenant may hold `new` for this service. `old` is the stored object's charge (None on
    create); `others` are what the tenant's other services hold (other tenants' entries are ignored);
    `contest` says why no tenant owns the namespace when several claim it (flotilla.ownership)."""
    namespace, name = key
    if old is not None and old.gpu_type == new.gpu_type and new.gpus <= old.gpus:
        # Also the operator's own writes (annotations, finalizers) and everything in a namespace that
        # lost its tenant or its quota: what is already admitted stays admitted.
        return Verdict(True, "the change does not raise the service's GPU charge", "NotRaised")
    if contest is not None and new.gpus > 0:
        return Verdict(
            False,
            f"InferenceService {namespace}/{name} asks for {new.gpus} GPUs, but {contest}; no quota "
            "admits GPUs there",
            "NamespaceContested",
        )
    if tenant is None or tenant_spec is None:
        return Verdict(
            False,
            f"namespace {namespace} belongs to no tenant: InferenceService {namespace}/{name} asks for "
            f"{new.gpus} GPUs, but no Tenant lists {namespace} in spec.namespaces or selects it, so "
            "there is no quota to charge and no tenant may use its services; ask the platform team to add "
            "the namespace to a Tenant, or, to share its services with every tenant, to the platform's "
            "shared Tenant (spec.shared: true), whose quota is charged",
            "NoTenant",
        )
    others = [h for h in others if h.tenant == tenant]
    services = len({h.key for h in others})  # a service may be charged twice: stored, and reserved
    if old is None and tenant_spec.max_services is not None and services >= tenant_spec.max_services:
        return Verdict(
            False,
            f"tenant {tenant}: InferenceService {namespace}/{name} would be service number "
            f"{services + 1}, but maxServices is {tenant_spec.max_services} and "
            f"{services} are in use",
            "MaxServicesExceeded",
        )
    if new.gpus == 0:
        return Verdict(True, f"tenant {tenant}: no GPUs asked", "NoGPUs")
    limit = limit_of(tenant_spec, new.gpu_type)
    if limit is None:
        quota = tenant_spec.gpu_quota
        named = f"GPU type {new.gpu_type!r}" if new.gpu_type else "no spec.resources.gpuType"
        return Verdict(
            False,
            f"tenant {tenant}: InferenceService {namespace}/{name} asks for {new.how} = {new.gpus} GPUs "
            f"of {named}, but the tenant's quota covers only: "
            f"{', '.join(f'{t} (limit {n})' for t, n in sorted(quota.items())) or 'no GPU types'}",
            "GPUTypeNotInQuota",
        )
    room = Headroom(limit, used_gpus(others, tenant, new.gpu_type))
    if room.admits(new.gpus):
        return Verdict(
            True,
            f"tenant {tenant}: {new.gpus} {new.gpu_type} GPUs admitted; "
            f"{room.in_use + new.gpus} of {limit} in use",
            "WithinQuota",
        )
    same_type = sorted((h for h in others if h.gpu_type == new.gpu_type and h.gpus), key=lambda h: h.key)
    holders = ", ".join(f"{'/'.join(h.key)}: {h.gpus}" for h in same_type)
    return Verdict(
        False,
        f"tenant {tenant}: InferenceService {namespace}/{name} asks for {new.how} = {new.gpus} "
        f"{new.gpu_type} GPUs, but the tenant's {new.gpu_type} quota is {limit} and {room.in_use} are in "
        f"use{f' ({holders})' if holders else ''}; {room.remaining} remain",
        "QuotaExceeded",
    )
