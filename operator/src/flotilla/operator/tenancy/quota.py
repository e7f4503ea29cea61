"""Quota: what each service holds of its tenant's GPU quota, the arithmetic on it, and the reconciler's
rule for how many replicas a quota admits. Pure, apart from the ledger's lock.

The one place quota is counted. The reconciler (`decide`) and the admission webhook (admission.review)
both ask it; they differ only in what a service is charged (see admission.py).
A service is charged replicas x gpus of its GPU type. Quota never removes running pods: when a quota
drops below use, the service keeps what it has and only scale-up is refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
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
    """What each service holds, one entry per service, under one lock (`with ledger.lock:` makes a
    check-then-hold atomic; the methods take it themselves too).

    Entries are firm (`hold` until `release`, or the whole set replaced by `settle`) or reservations
    (`reserve`): an admission whose object the watch has not delivered yet. A reservation counts, over a
    firm entry for the same service, until `settle` sees that service hold the same, or `ttl` seconds pass
    (then the object was never stored, or it was and the index has it). Until then it errs towards
    refusing, never towards over-quota."""

    def __init__(self, ttl: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.lock = threading.RLock()
        self._firm: dict[Key, Held] = {}
        self._reserved: dict[Key, tuple[Held, float]] = {}  # key -> (held, expiry)
        self._ttl = ttl
        self._clock = clock

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
            self._reserved.pop(key, None)
            return self._firm.pop(key, None)

    def reserve(self, held: Held) -> None:
        with self.lock:
            self._reserved[held.key] = (held, self._clock() + self._ttl)

    def settle(self, firm: Mapping[Key, Held]) -> None:
        """The firm entries become `firm` (what the index shows); reservations it confirms, or that
        expired, go."""
        with self.lock:
            now = self._clock()
            self._firm = dict(firm)
            for key, (held, expiry) in list(self._reserved.items()):
                if expiry <= now or firm.get(key) == held:
                    del self._reserved[key]

    def entries(self, tenant: str | None = None) -> list[Held]:
        """Every service's entry (of `tenant`, if given); a reservation stands in for a firm entry."""
        with self.lock:
            merged = {**self._firm, **{k: h for k, (h, _) in self._reserved.items()}}
        return [h for h in merged.values() if tenant is None or h.tenant == tenant]

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
