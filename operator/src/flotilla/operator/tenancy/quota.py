"""Quota: what each service holds of its tenant's GPU quota, the arithmetic on it, and the reconciler's
rule for how many replicas a quota admits. Pure, apart from the ledger's lock.

The one place quota is counted. The reconciler (`granted_replicas`) and the admission webhook
(quota_review.review) both ask it; they differ only in what a service is charged (see quota_review.py)
and where their ledger lives (the reconciler's in memory, the webhook's in the API: reservations.py).
A service is charged replicas x gpus of its GPU type. Quota never removes running pods: when a quota
drops below use, the service keeps what it has and only scale-up is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from flotilla.operator.api.v1alpha1 import TenantSpec

Key = tuple[str, str]  # (namespace, InferenceService name)


@dataclass(frozen=True)
class Held:
    """GPUs one service holds (or has been granted, or is charged) under its tenant."""

    key: Key
    tenant: str
    gpu_type: str | None
    gpus: int


def used_gpus(held: Iterable[Held], tenant: str, gpu_type: str | None) -> int:
    return sum(h.gpus for h in held if h.tenant == tenant and h.gpu_type == gpu_type)


def limit_of(tenant_spec: TenantSpec, gpu_type: str | None) -> int | None:
    """The tenant's quota for this GPU type; None when the quota has no line for it (nothing to charge)."""
    return tenant_spec.gpu_quota.get(gpu_type) if gpu_type is not None else None


@dataclass(frozen=True)
class Headroom:
    """One quota line (a tenant's limit for one GPU type) and what is in use of it."""

    limit: int
    in_use: int

    def admits(self, gpus: int) -> bool:
        return self.in_use + gpus <= self.limit

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.in_use)

    def replicas_that_fit(self, gpus_per_replica: int) -> int:
        return self.remaining // gpus_per_replica


class Ledger:
    """The reconciler's grants: what each service's Deployment holds, one entry per service, under one lock
    (`with ledger.lock:` makes a check-then-hold atomic; the methods take it themselves too). Only the
    active operator replica reconciles, so this lives in its memory; the admission webhook, which every
    replica answers, keeps its ledger in the API instead (reservations.py)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._firm: dict[Key, Held] = {}

    def hold(self, held: Held) -> None:
        with self.lock:
            self._firm[held.key] = held

    def seed(self, held: Iterable[Held]) -> None:
        """Entries for services the ledger does not know yet (after a restart, from their status)."""
        with self.lock:
            for h in held:
                self._firm.setdefault(h.key, h)

    def release(self, key: Key) -> Held | None:
        with self.lock:
            return self._firm.pop(key, None)

    def get(self, key: Key) -> Held | None:
        with self.lock:
            return self._firm.get(key)

    def entries(self, tenant: str | None = None) -> list[Held]:
        """Every service's entry (of `tenant`, if given)."""
        with self.lock:
            held = list(self._firm.values())
        return [h for h in held if tenant is None or h.tenant == tenant]

    def others(self, key: Key, tenant: str | None = None) -> list[Held]:
        """What services other than `key` hold (of `tenant`, if given)."""
        return [h for h in self.entries(tenant) if h.key != key]


# ---------------------------------------------------------------------------------------------------
# The reconciler's rule: a service that slips past admission (or whose quota was lowered) is held back
# with a reason in status.


@dataclass(frozen=True)
class QuotaDecision:
    replicas: int
    admitted: bool
    reason: str
    message: str


def granted_replicas(
    *,
    tenant: str | None,
    tenant_spec: TenantSpec | None,
    gpu_type: str | None,
    gpus_per_replica: int,
    requested: int,
    current: int,
    used_by_others: int,
    contest: str | None = None,
) -> QuotaDecision:
    """The replicas the tenant's quota grants a service that asks for `requested`, and why (the reconciler
    runs that many; the autoscaler asks how far it may grow). `current` is how many the service runs now;
    `used_by_others` is what the tenant's other services hold of this GPU type; `contest` says why no
    tenant owns the namespace when several claim it: then no quota grants GPUs there, and what already
    runs is kept."""
    if contest is not None and gpus_per_replica > 0:
        return QuotaDecision(min(requested, current), False, "NamespaceContested", contest)
    if tenant is None or tenant_spec is None:
        return QuotaDecision(requested, True, "NoTenant", "no Tenant claims this namespace; no quota applies")
    if gpus_per_replica == 0:
        return QuotaDecision(requested, True, "NoGPUs", f"tenant {tenant}: the service requests no GPUs")
    limit = limit_of(tenant_spec, gpu_type)
    if limit is None:
        # Without a quota line there is nothing to charge; never shrink what already runs.
        kinds = ", ".join(sorted(tenant_spec.gpu_quota)) or "none"
        named = f"GPU type {gpu_type!r}" if gpu_type else "no gpuType"
        return QuotaDecision(
            min(requested, current),
            False,
            "GPUTypeNotInQuota",
            f"tenant {tenant}: the service asks for {named}, but the tenant's quota covers: {kinds}",
        )
    room = Headroom(limit, used_by_others)
    asked = requested * gpus_per_replica
    if room.admits(asked):
        return QuotaDecision(
            requested,
            True,
            "WithinQuota",
            f"tenant {tenant}: {asked} {gpu_type} GPUs granted; {used_by_others + asked} of {limit} in use",
        )
    replicas = min(requested, max(room.replicas_that_fit(gpus_per_replica), current))
    return QuotaDecision(
        replicas,
        False,
        "QuotaExceeded",
        f"tenant {tenant}: asked for {requested} replicas x {gpus_per_replica} {gpu_type} GPUs = {asked}, "
        f"but the quota is {limit} and other services use {used_by_others}; running {replicas} replicas",
    )
