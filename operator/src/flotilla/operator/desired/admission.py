"""One admission review of an InferenceService, as a pure function: the webhook's counterpart of
reconcile.plan, and built from the same parts.

First the reconciler's own validation (validation.check), so the webhook refuses what the Valid
condition would mark invalid, in the same words; then the tenant's quota (tenancy.admission.review).
The rules that depend on the world (GPU types on the nodes, model paths) are left to the reconciler: the
world changes (a node joins, a volume is filled) and the reconciler re-checks them when it does, while
admission is asked once.
"""

from __future__ import annotations

from collections.abc import Iterable

from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.operator.desired.validation import check, describe, parse_spec
from flotilla.operator.tenancy.admission import Verdict, charge, review
from flotilla.operator.tenancy.quota import Held, Key


def charged(key: Key, tenant: str, raw_spec: dict) -> Held | None:
    """What a stored service is charged (None when its spec does not parse)."""
    spec, _ = parse_spec(raw_spec)
    if spec is None:
        return None
    c = charge(spec)
    return Held(key, tenant, c.gpu_type, c.gpus)


def review_service(
    *,
    key: Key,
    new_raw: dict,
    old_raw: dict | None,
    tenant: str | None,
    tenant_spec: TenantSpec | None,
    others: Iterable[Held],
    contest: str | None = None,
) -> tuple[Verdict, Held | None]:
    """The verdict on a create (`old_raw` None) or an update of the spec, and what the service is charged
    once admitted (None when nothing is)."""
    new, problems = check(new_raw)
    if problems and new_raw != old_raw:
        # Only a changed spec is judged: the operator's own writes (finalizers, annotations) to an object
        # stored before the webhook was on must pass, or it could never be deleted.
        return Verdict(False, describe(problems), problems[0].reason, code=422), None
    if new is None:
        return Verdict(True, "the spec did not change", "Unchanged"), None
    old = parse_spec(old_raw)[0] if old_raw is not None else None
    new_charge = charge(new)
    verdict = review(
        key=key,
        tenant=tenant,
        tenant_spec=tenant_spec,
        new=new_charge,
        old=charge(old) if old is not None else None,
        others=others,
        contest=contest,
    )
    held = Held(key, tenant, new_charge.gpu_type, new_charge.gpus) if tenant else None
    return verdict, held
