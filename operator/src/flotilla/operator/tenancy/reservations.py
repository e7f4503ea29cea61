"""Reservations: what the admission webhook has admitted that the API may not have stored yet. Pure.

The ledger's truth lives in the API, where every operator replica sees it, not in a replica's memory:
one ConfigMap per Tenant (clients/quota_ledger.py) holds its live reservations, and a review writes its
reservation with the ConfigMap's resourceVersion (optimistic concurrency), so two reviews of one tenant,
whichever replicas answer them, serialize on that write: the loser re-reads and sees the winner's
reservation. Kueue does the same for quota reservations: a Workload's admission is an API object written
with optimistic concurrency, never a controller's memory. Kopf's peering is no help here: it pauses a
standby's handlers and indexes, not its webhook, and the API server spreads reviews over all replicas.

The ConfigMap holds two kinds of reservation (`Reserved`), each counted against its own limit:
- an InferenceService's GPUs (`Reservation`), against the Tenant's gpuQuota and maxServices;
- a LoRAAdapter object (`AdapterReservation`), against its maxLoRAAdapters (tenancy/lora_limit.py).
A review of either kind writes the whole ConfigMap, so both kinds serialize on the same write.

What a tenant is charged at review time: each stored object of its namespaces (read fresh from the API,
not from a watch index, which may lag or be frozen on a standby), and each live reservation over it. The
ConfigMap is read before the stored objects are listed: a reservation leaves the ConfigMap only once a
review saw its object stored (or it expired or was released), so whatever a review does not find
reserved it finds stored, and whatever is reserved after its read fails its write.

A reservation lives until the stored object shows the charge it reserved (confirmed), the object it
reserved for is gone and another with its name stands there, or `RESERVATION_TTL_SECONDS` pass: the
longest an admitted write can take to be stored after the webhook answered. The TTL errs towards
refusing: a create admitted and then deleted within the TTL holds its GPUs (or its adapter slot) until
the TTL ends or the operator sees the deletion (it releases the reservation: controllers/service_events.py,
controllers/lora_adapters.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flotilla.operator.tenancy.quota import Held, Key

# Longer than the API server's webhook timeout (at most 30 s, the chart's default 10 s): after that, a
# write the webhook admitted is stored or failed.
RESERVATION_TTL_SECONDS = 30.0


@dataclass(frozen=True)
class Reservation:
    held: Held
    uid: str  # the object's uid as the review saw it ("" when the request had none)
    expires: float  # unix time

    @property
    def key(self) -> Key:
        return self.held.key


@dataclass(frozen=True)
class Stored:
    """A stored InferenceService as the charge sees it."""

    uid: str
    held: Held | None  # None when its spec does not parse (nothing is charged)


@dataclass(frozen=True)
class AdapterReservation:
    """A LoRAAdapter create the webhook admitted: one of the tenant's maxLoRAAdapters until stored."""

    key: Key  # (namespace, LoRAAdapter name)
    uid: str  # the object's uid as the review saw it ("" when the request had none)
    expires: float  # unix time


@dataclass(frozen=True)
class Reserved:
    """One tenant's reservations, as its ConfigMap holds them."""

    services: tuple[Reservation, ...] = ()
    adapters: tuple[AdapterReservation, ...] = ()

    def unexpired(self, now: float) -> Reserved:
        """Without what expired: either kind's review drops both kinds' expired entries."""
        return Reserved(
            tuple(r for r in self.services if r.expires > now),
            tuple(a for a in self.adapters if a.expires > now),
        )

    def with_services(self, services: Iterable[Reservation]) -> Reserved:
        return Reserved(tuple(services), self.adapters)

    def with_adapters(self, adapters: Iterable[AdapterReservation]) -> Reserved:
        return Reserved(self.services, tuple(adapters))


# An adapter's data key: `lora_<namespace>.<name>`. A service's key starts with its namespace, a DNS label,
# which has no underscore, so the two never collide.
ADAPTER_KEY_PREFIX = "lora_"


def data_key(key: Key) -> str:
    """A ConfigMap data key for a service: namespaces (DNS labels) have no dots, so the first dot splits."""
    return f"{key[0]}.{key[1]}"


def adapter_data_key(key: Key) -> str:
    return ADAPTER_KEY_PREFIX + data_key(key)


def parse(tenant: str, data: Mapping[str, str] | None) -> Reserved:
    services, adapters = [], []
    for name, text in (data or {}).items():
        is_adapter = name.startswith(ADAPTER_KEY_PREFIX)
        namespace, _, obj = name.removeprefix(ADAPTER_KEY_PREFIX).partition(".")
        try:
            entry = json.loads(text)
            uid, expires = str(entry.get("uid") or ""), float(entry["expires"])
            if is_adapter:
                adapters.append(AdapterReservation((namespace, obj), uid, expires))
            else:
                held = Held((namespace, obj), tenant, entry.get("gpuType"), int(entry["gpus"]))
                services.append(Reservation(held, uid, expires))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a hand-edited entry we cannot read reserves nothing
    return Reserved(tuple(services), tuple(adapters))


def serialize(reserved: Reserved) -> dict[str, str]:
    data = {
        data_key(r.key): json.dumps(
            {"gpuType": r.held.gpu_type, "gpus": r.held.gpus, "uid": r.uid, "expires": round(r.expires, 3)},
            sort_keys=True,
        )
        for r in reserved.services
    }
    for a in reserved.adapters:
        data[adapter_data_key(a.key)] = json.dumps(
            {"uid": a.uid, "expires": round(a.expires, 3)}, sort_keys=True
        )
    return data


def live(reservations: Iterable[Reservation], stored: Mapping[Key, Stored], now: float) -> list[Reservation]:
    """The reservations that still count: unexpired, not yet confirmed by the stored object, and not for
    an object that another of the same name has replaced."""
    out = []
    for r in reservations:
        if r.expires <= now:
            continue
        current = stored.get(r.key)
        if current is not None:
            if r.uid and current.uid and current.uid != r.uid:
                continue  # what it reserved for was deleted; another object holds the name now
            if current.held is not None and (current.held.gpu_type, current.held.gpus) == (
                r.held.gpu_type,
                r.held.gpus,
            ):
                continue  # stored: the firm charge says the same
        out.append(r)
    return out


def charges(stored: Mapping[Key, Stored], reservations: Iterable[Reservation]) -> list[Held]:
    """What the tenant is charged, per service: its stored charge and its live reservation; of one GPU type
    the larger of the two, of two types both (an update that changes the type is not stored yet, and may
    never be)."""
    by_key_type: dict[tuple[Key, str | None], Held] = {}
    entries = [s.held for s in stored.values() if s.held is not None] + [r.held for r in reservations]
    for held in entries:
        slot = (held.key, held.gpu_type)
        if slot not in by_key_type or held.gpus > by_key_type[slot].gpus:
            by_key_type[slot] = held
    return sorted(by_key_type.values(), key=lambda h: (h.key, h.gpu_type or ""))


def live_adapters(
    reservations: Iterable[AdapterReservation], stored: Iterable[Key], now: float
) -> list[AdapterReservation]:
    """The adapter reservations that still count: unexpired and not stored under their name. A stored
    adapter of that name counts by itself, whether it is the one reserved for (confirmed) or another that
    took the name (the reserved create then failed: AlreadyExists), so either way the reservation goes."""
    names = set(stored)
    return [a for a in reservations if a.expires > now and a.key not in names]


def without(reserved: Reserved, key: Key, uid: str, *, adapter: bool) -> Reserved:
    """`reserved` less the reservation for `key` of the object with this uid (or any, where either uid is
    unknown): what the operator writes when it sees that object deleted."""

    def mine(k: Key, u: str) -> bool:
        return k == key and (not uid or u in ("", uid))

    if adapter:
        return reserved.with_adapters(a for a in reserved.adapters if not mine(a.key, a.uid))
    return reserved.with_services(r for r in reserved.services if not mine(r.key, r.uid))


# Tenants' namespace claims, the same way: a Tenant admitted moments ago may not be stored yet when another
# Tenant claiming the same namespace is reviewed (on this replica or another), so each admitted claim is
# written, with optimistic concurrency, to one ConfigMap that every Tenant review reads.
Claims = dict[str, tuple[dict, float]]  # Tenant name -> (its spec as admitted, expiry)


def pending_claims(data: Mapping[str, str] | None, stored: Mapping[str, dict], now: float) -> Claims:
    """The claims that still count: unexpired, and not yet stored as admitted."""
    out: Claims = {}
    for name, text in (data or {}).items():
        try:
            entry = json.loads(text)
            spec, expires = dict(entry["spec"]), float(entry["expires"])
        except (ValueError, KeyError, TypeError):
            continue
        if expires > now and stored.get(name) != spec:
            out[name] = (spec, expires)
    return out


def claims_data(claims: Claims) -> dict[str, str]:
    return {
        name: json.dumps({"spec": spec, "expires": round(expires, 3)}, sort_keys=True)
        for name, (spec, expires) in claims.items()
    }
