"""Runtime quota: how many replicas of a service its tenant's GPU quota admits. Pure.

The tenancy issue adds the admission webhook; this is the reconciler's own check of the same rule, so a
service that slips past admission (or whose quota was lowered) is held back with a reason in status.
A service is charged replicas x gpus of its GPU type. Quota never removes running pods: when a quota
drops below use, the service keeps what it has and only scale-up is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flotilla.operator.api.v1alpha1 import TenantSpec


@dataclass(frozen=True)
class Grant:
    """GPUs one service holds (or has been granted) under its tenant."""

    tenant: str
    gpu_type: str | None
    gpus: int


@dataclass(frozen=True)
class QuotaDecision:
    replicas: int
    admitted: bool
    reason: str
    message: str


def used_gpus(grants: Iterable[Grant], tenant: str, gpu_type: str | None) -> int:
    return sum(g.gpus for g in grants if g.tenant == tenant and g.gpu_type == gpu_type)


def decide(
    *,
    tenant: str | None,
    tenant_spec: TenantSpec | None,
    gpu_type: str | None,
    gpus_per_replica: int,
    requested: int,
    current: int,
    used_by_others: int,
) -> QuotaDecision:
    """Replicas to run. `current` is how many the service runs now; `used_by_others` is what the tenant's
    other services hold of this GPU type."""
    if tenant is None or tenant_spec is None:
        return QuotaDecision(requested, True, "NoTenant", "no Tenant claims this namespace; no quota applies")
    if gpus_per_replica == 0:
        return QuotaDecision(requested, True, "NoGPUs", f"tenant {tenant}: the service requests no GPUs")
    if gpu_type is None or gpu_type not in tenant_spec.gpu_quota:
        # Without a type there is no quota line to charge; never shrink what already runs.
        kinds = ", ".join(sorted(tenant_spec.gpu_quota)) or "none"
        named = f"GPU type {gpu_type!r}" if gpu_type else "no gpuType"
        return QuotaDecision(
            min(requested, current),
            False,
            "GPUTypeNotInQuota",
            f"tenant {tenant}: the service asks for {named}, but the tenant's quota covers: {kinds}",
        )
    limit = tenant_spec.gpu_quota[gpu_type]
    asked = requested * gpus_per_replica
    if used_by_others + asked <= limit:
        return QuotaDecision(
            requested,
            True,
            "WithinQuota",
            f"tenant {tenant}: {asked} {gpu_type} GPUs granted; {used_by_others + asked} of {limit} in use",
        )
    fits = max(0, (limit - used_by_others) // gpus_per_replica)
    replicas = min(requested, max(fits, current))
    return QuotaDecision(
        replicas,
        False,
        "QuotaExceeded",
        f"tenant {tenant}: asked for {requested} replicas x {gpus_per_replica} {gpu_type} GPUs = {asked}, "
        f"but the quota is {limit} and other services use {used_by_others}; running {replicas} replicas",
    )
