"""The Tenant's spec.maxLoRAAdapters: how many LoRAAdapter objects its namespaces may hold, enforced by the
admission webhook when one is created (controllers/webhook_reviews.py). Pure: the webhook reads the
tenant's adapter reservations (the quota ledger's ConfigMap: tenancy/reservations.py) and then its stored
adapters fresh from the API, and asks `adapter_limit_refusal`. A create it admits is reserved in that
ConfigMap with optimistic concurrency, so creates reviewed at once, by any replicas, never pass the limit."""

from __future__ import annotations

from collections.abc import Iterable

from flotilla.operator.tenancy.quota import Key


def adapter_limit_refusal(
    *,
    tenant: str | None,
    limit: int | None,
    namespace: str,
    name: str,
    existing: Iterable[Key],
    reserved: Iterable[Key] = (),
) -> str | None:
    """Why admission refuses creating the LoRAAdapter namespace/name, given the (namespace, name) of the
    tenant's stored adapters and of those admitted but not stored yet (its live reservations); None when
    it may be created. No tenant, or no limit: no refusal."""
    if tenant is None or limit is None:
        return None
    stored = {key for key in existing if key != (namespace, name)}
    pending = {key for key in reserved if key != (namespace, name)} - stored
    count = len(stored) + len(pending)
    if count < limit:
        return None
    moments_ago = f" ({len(pending)} of them admitted moments ago, not stored yet)" if pending else ""
    return (
        f"tenant {tenant}: LoRAAdapter {namespace}/{name} would be adapter number {count + 1}, but "
        f"maxLoRAAdapters is {limit} and {count} are registered{moments_ago}; delete one, or ask the "
        "platform team to raise the limit"
    )
