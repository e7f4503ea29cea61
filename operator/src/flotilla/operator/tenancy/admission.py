"""Admission of InferenceServices against their Tenant's quota. Pure, apart from the ledger's lock.

What a service is charged at admission (`charge`):
- a fixed service: replicas x gpus;
- an autoscaled service: maxReplicas x gpus. Admission is the only place a tenant hears a plain "no"
  while applying. Charging minReplicas would admit services whose autoscalers then compete for the
  same GPUs at runtime, and the loser's latency target silently breaks exactly when load is high
  (the problem LLMKube #1338 shows). Charging the maximum means every admitted service can always
  reach its maxReplicas; the runtime clamp (quota.py) stays as the backstop for quotas lowered later.

Updates that do not raise a service's charge are always admitted, so a lowered quota never blocks
edits, the operator's own annotation writes, or scaling down.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from flotilla.operator.api.v1alpha1 import InferenceServiceSpec, TenantSpec

Key = tuple[str, str]  # (namespace, name)


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
class Held:
    """What one other service of the tenant is charged."""

    key: Key
    gpu_type: str | None
    gpus: int


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    message: str
    reason: str


def review(
    *,
    key: Key,
    tenant: str | None,
    tenant_spec: TenantSpec | None,
    new: Charge,
    old: Charge | None,
    others: Iterable[Held],
) -> Verdict:
    """Whether the tenant may hold `new` for this service. `old` is the stored object's charge (None on
    create); `others` are the tenant's other services."""
    namespace, name = key
    if old is not None and old.gpu_type == new.gpu_type and new.gpus <= old.gpus:
        # Also the operator's own writes (annotations, finalizers) and everything in a namespace that
        # lost its tenant or its quota: what is already admitted stays admitted.
        return Verdict(True, "the change does not raise the service's GPU charge", "NotRaised")
    if tenant is None or tenant_spec is None:
        return Verdict(
            False,
            f"namespace {namespace} belongs to no tenant: InferenceService {namespace}/{name} asks for "
            f"{new.gpus} GPUs, but no Tenant lists {namespace} in spec.namespaces or selects it, so "
            "there is no quota to charge; ask the platform team to add the namespace to a Tenant",
            "NoTenant",
        )
    others = list(others)
    if old is None and tenant_spec.max_services is not None and len(others) >= tenant_spec.max_services:
        return Verdict(
            False,
            f"tenant {tenant}: InferenceService {namespace}/{name} would be service number "
            f"{len(others) + 1}, but maxServices is {tenant_spec.max_services} and "
            f"{len(others)} are in use",
            "MaxServicesExceeded",
        )
    if new.gpus == 0:
        return Verdict(True, f"tenant {tenant}: no GPUs asked", "NoGPUs")
    quota = tenant_spec.gpu_quota
    if new.gpu_type is None or new.gpu_type not in quota:
        named = f"GPU type {new.gpu_type!r}" if new.gpu_type else "no spec.resources.gpuType"
        return Verdict(
            False,
            f"tenant {tenant}: InferenceService {namespace}/{name} asks for {new.how} = {new.gpus} GPUs "
            f"of {named}, but the tenant's quota covers only: "
            f"{', '.join(f'{t} (limit {n})' for t, n in sorted(quota.items())) or 'no GPU types'}",
            "GPUTypeNotInQuota",
        )
    limit = quota[new.gpu_type]
    same_type = [h for h in others if h.gpu_type == new.gpu_type and h.gpus]
    in_use = sum(h.gpus for h in same_type)
    if in_use + new.gpus <= limit:
        return Verdict(
            True,
            f"tenant {tenant}: {new.gpus} {new.gpu_type} GPUs admitted; {in_use + new.gpus} of {limit} in use",
            "WithinQuota",
        )
    holders = ", ".join(f"{ns}/{n}: {h.gpus}" for (ns, n), h in sorted((h.key, h) for h in same_type))
    return Verdict(
        False,
        f"tenant {tenant}: InferenceService {namespace}/{name} asks for {new.how} = {new.gpus} "
        f"{new.gpu_type} GPUs, but the tenant's {new.gpu_type} quota is {limit} and {in_use} are in use"
        f"{f' ({holders})' if holders else ''}; {max(0, limit - in_use)} remain",
        "QuotaExceeded",
    )


class Ledger:
    """Makes check-then-admit atomic. The API server may send two reviews at once; the watch that feeds
    the service index delivers an admitted object only later. So each admission holds its charge here
    until the index shows the object with that charge, or `ttl` seconds pass (then the object was never
    stored, or it was, and the index has it). Until then a reservation counts as in use: erring towards
    refusing, never towards over-quota."""

    def __init__(self, ttl: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._reserved: dict[Key, tuple[str, Held, float]] = {}  # key -> (tenant, charge, expiry)
        self._ttl = ttl
        self._clock = clock

    def held(self, tenant: str, indexed: Mapping[Key, tuple[str, Held]], exclude: Key) -> list[Held]:
        """What the tenant's services other than `exclude` hold: indexed charges, overridden by
        reservations the index has not caught up with. Call under `lock()`."""
        now = self._clock()
        for key, (_, held, expiry) in list(self._reserved.items()):
            seen = indexed.get(key)
            if expiry <= now or (seen is not None and seen[1] == held):
                del self._reserved[key]
        merged = {k: v for k, v in indexed.items()}
        merged.update({k: (t, h) for k, (t, h, _) in self._reserved.items()})
        return [h for k, (t, h) in merged.items() if t == tenant and k != exclude]

    def reserve(self, tenant: str, held: Held) -> None:
        self._reserved[held.key] = (tenant, held, self._clock() + self._ttl)

    def lock(self) -> threading.Lock:
        return self._lock
