"""The Tenant's spec.maxLoRAAdapters: how many LoRAAdapter objects its namespaces may hold, enforced by the
admission webhook when one is created (controllers/webhook_reviews.py). Pure: the webhook reads the
tenant and its stored adapters fresh from the API and asks `adapter_limit_refusal`."""

from __future__ import annotations

from collections.abc import Iterable


def adapter_limit_refusal(
    *, tenant: str | None, limit: int | None, namespace: str, name: str, existing: Iterable[tuple[str, str]]
) -> str | None:
    """Why admission refuses creating the LoRAAdapter namespace/name, given the (namespace, name) of the
    tenant's stored adapters; None when it may be created. No tenant, or no limit: no refusal."""
    if tenant is None or limit is None:
        return None
    others = {key for key in existing if key != (namespace, name)}
    if len(others) < limit:
        return None
    return (
        f"tenant {tenant}: LoRAAdapter {namespace}/{name} would be adapter number {len(others) + 1}, but "
        f"maxLoRAAdapters is {limit} and {len(others)} are registered; delete one, or ask the platform team "
        "to raise the limit"
    )
