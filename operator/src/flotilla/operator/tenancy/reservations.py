"""Quota reservations: what the admission webhook has admitted that the API may not have stored yet. Pure.

The ledger's truth lives in the API, where every operator replica sees it, not in a replica's memory:
one ConfigMap per Tenant (clients/quota_ledger.py) holds its live reservations, and a review writes its
reservation with the ConfigMap's resourceVersion (optimistic concurrency), so two reviews of one tenant,
whichever replicas answer them, serialize on that write: the loser re-reads and sees the winner's
reservation. Kueue does the same for quota reservations: a Workload's admission is an API object written
with optimistic concurrency, never a controller's memory. Kopf's peering is no help here: it pauses a
standby's handlers and indexes, not its webhook, and the API server spreads reviews over all replicas.

What a tenant is charged at review time: each stored InferenceService of its namespaces (read fresh from
the API, not from a watch index, which may lag or be frozen on a standby), and each live reservation
over it. A reservation lives until the stored object shows the charge it reserved (confirmed), the
object it reserved for is gone and another with its name stands there, or `RESERVATION_TTL_SECONDS`
pass: the longest an admitted write can take to be stored after the webhook answered. The TTL errs
towards refusing: a create admitted and then deleted within the TTL holds its GPUs until the TTL ends
or the operator sees the deletion (controllers/webhook_reviews.py releases it).
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


def data_key(key: Key) -> str:
    """A ConfigMap data key for a service: namespaces (DNS labels) have no dots, so the first dot splits."""
    return f"{key[0]}.{key[1]}"


def parse(tenant: str, data: Mapping[str, str] | None) -> list[Reservation]:
    out = []
    for name, text in (data or {}).items():
        namespace, _, service = name.partition(".")
        try:
            entry = json.loads(text)
            held = Held((namespace, service), tenant, entry.get("gpuType"), int(entry["gpus"]))
            out.append(Reservation(held, str(entry.get("uid") or ""), float(entry["expires"])))
        except (ValueError, KeyError, TypeError):
            continue  # a hand-edited entry we cannot read reserves nothing
    return out


def serialize(reservations: Iterable[Reservation]) -> dict[str, str]:
    return {
        data_key(r.key): json.dumps(
            {"gpuType": r.held.gpu_type, "gpus": r.held.gpus, "uid": r.uid, "expires": round(r.expires, 3)},
            sort_keys=True,
        )
        for r in reservations
    }


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
