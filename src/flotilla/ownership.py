"""Which Tenant owns a namespace: the one rule that every part calls.

The operator (admission, reconcile, RBAC, ResourceQuota, metering, autoscaling) and the gateway (keys,
model lists, routing) both decide who owns a namespace, and two copies of that rule once disagreed: the
gateway read `spec.namespaces` only, so a namespace claimed by label was open to every tenant. Both now
call this module (stdlib only, so either half may import it; `tests/test_ownership.py` runs every
consumer against one table and fails on a second copy of the rule).

A Tenant claims a namespace
- by name: `spec.namespaces` lists it (whether or not it exists yet), or
- by labels: `spec.namespaceSelector`, a Kubernetes LabelSelector (`matchLabels` and `matchExpressions`
  with In, NotIn, Exists, DoesNotExist, all ANDed) matches the namespace's labels. A namespace that does
  not exist has no labels, so no selector claims it. An empty selector (`{}`) claims nothing: in
  Kubernetes `{}` selects everything, and a Tenant that owned every namespace of the cluster, system ones
  included, by an omission is never what a platform team meant.

A namespace claimed by exactly one Tenant is owned by it. A namespace claimed by none is owned by nobody:
*unowned*, it is nobody's to use (no tenant's key reaches its services, no adapter of another namespace
may use them as a base) and the admission webhook refuses InferenceServices there, since no quota could
be charged. A namespace claimed by two or more Tenants is *contested*: the second Tenant is refused at
admission, but where the claim arises later (a relabelled namespace, Tenants written while the webhook was
off) neither claimant gets it: no tenant's key reaches its services, no quota admits GPUs there, and both
Tenants say so in a condition.

Sharing is granted, never implied by a missing claim: a namespace is *shared* when the Tenant that owns it
is marked `spec.shared: true`, the platform's shared Tenant (`Owner.shared`, decided in `owner_of` and
nowhere else). Its services are open to every tenant's key and may be the base of any tenant's
LoRAAdapter; like any Tenant's, its GPUs are admitted against and metered to its own quota (the platform's
budget), never to nobody. A contested namespace is never shared.

Tenant specs are read as stored (camelCase keys), so the gateway passes its watch objects' `spec` and the
operator its pydantic models dumped by alias.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TenantSpecs = Mapping[str, Mapping[str, Any]]  # Tenant name -> its spec as stored
NamespaceLabels = Mapping[str, Mapping[str, str]]  # existing namespace -> its labels

SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


@dataclass(frozen=True)
class Owner:
    """Who owns one namespace."""

    namespace: str
    claimants: tuple[str, ...] = ()  # every Tenant that claims it, sorted
    # The one owner is the platform's shared Tenant (spec.shared): every tenant may use the namespace's
    # services. Only owner_of decides it; never True for a namespace that is unowned or contested.
    shared: bool = False

    @property
    def tenant(self) -> str | None:
        """The owning Tenant: the one claimant, or None (unclaimed or contested)."""
        return self.claimants[0] if len(self.claimants) == 1 else None

    @property
    def contested(self) -> bool:
        return len(self.claimants) > 1

    def contest_message(self) -> str:
        return (
            f"namespace {self.namespace} is claimed by tenants {', '.join(self.claimants)}; a namespace "
            "can belong to one tenant only, so none of them owns it until the others stop claiming it"
        )


def _requirement_matches(requirement: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op = requirement.get("key") or "", requirement.get("operator")
    values = requirement.get("values") or []
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    return False  # an operator the schema should have refused never matches


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str] | None) -> bool:
    """Whether a LabelSelector (as stored) selects a namespace with these labels (None: no such namespace)."""
    if not selector or labels is None:
        return False
    match_labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not match_labels and not expressions:
        return False
    return all(labels.get(k) == v for k, v in match_labels.items()) and all(
        _requirement_matches(r, labels) for r in expressions
    )


def claims(spec: Mapping[str, Any], namespace: str, labels: Mapping[str, str] | None) -> bool:
    """Whether a Tenant with this spec claims the namespace (labels None: it does not exist)."""
    if namespace in (spec.get("namespaces") or ()):
        return True
    return selector_matches(spec.get("namespaceSelector"), labels)


def owner_of(namespace: str, tenants: TenantSpecs, namespace_labels: NamespaceLabels) -> Owner:
    """Who owns the namespace, and whether it is shared: the one place that reads a Tenant's
    `spec.shared` (the namespaces of the one Tenant that claims it, when that Tenant is marked shared)."""
    labels = namespace_labels.get(namespace)
    claimants = tuple(sorted(n for n, spec in tenants.items() if claims(spec, namespace, labels)))
    shared = len(claimants) == 1 and tenants[claimants[0]].get("shared") is True
    return Owner(namespace, claimants, shared)


def may_use(tenant: str | None, owner: str | None, *, contested: bool, shared: bool) -> bool:
    """Whether a caller of `tenant` (None: no key, a static fleet) may use a service in a namespace owned
    by `owner` (None: no Tenant, or several: `contested`; `shared`: Owner.shared): a shared namespace's
    services are every tenant's (and a caller's without a tenant); a tenant's namespace is that tenant's
    alone; an unowned one is nobody's (sharing is granted by a shared Tenant, never implied by a missing
    claim); a contested one is nobody's until the claim is resolved. The gateway asks it of every request
    (a key's tenant), and the operator of every LoRAAdapter on a base service in another namespace (the
    adapter's tenant; adapter_may_use)."""
    if contested:
        return False
    if shared:
        return True
    return owner is not None and owner == tenant


def adapter_may_use(adapter: Owner, base: Owner) -> bool:
    """Whether a LoRAAdapter in the namespace `adapter` describes may be served by a base service in the
    namespace `base` describes: its own namespace always; another one only for an adapter that has a
    tenant (not unowned, not contested) and where that tenant may use the namespace's services (may_use:
    shared, or its own)."""
    if adapter.namespace == base.namespace:
        return True
    if adapter.tenant is None:
        return False
    return may_use(adapter.tenant, base.tenant, contested=base.contested, shared=base.shared)


def namespaces_claimed(spec: Mapping[str, Any], namespace_labels: NamespaceLabels) -> list[str]:
    """Every namespace a Tenant claims: those it lists (existing or not) and the existing ones it selects."""
    found = set(spec.get("namespaces") or ())
    found.update(ns for ns, labels in namespace_labels.items() if claims(spec, ns, labels))
    return sorted(found)


def namespaces_owned(tenant: str, tenants: TenantSpecs, namespace_labels: NamespaceLabels) -> list[str]:
    """The namespaces the Tenant owns: those it claims that no other Tenant claims too."""
    spec = tenants.get(tenant)
    if spec is None:
        return []
    return [
        ns for ns in namespaces_claimed(spec, namespace_labels)
        if owner_of(ns, tenants, namespace_labels).tenant == tenant
    ]  # fmt: skip


def contested(tenants: TenantSpecs, namespace_labels: NamespaceLabels) -> list[Owner]:
    """Every namespace that two or more Tenants claim, sorted by namespace."""
    names: set[str] = set(namespace_labels)
    for spec in tenants.values():
        names.update(spec.get("namespaces") or ())
    owners = (owner_of(ns, tenants, namespace_labels) for ns in sorted(names))
    return [o for o in owners if o.contested]


def conflicts(
    name: str, spec: Mapping[str, Any], others: TenantSpecs, namespace_labels: NamespaceLabels
) -> list[tuple[str, str]]:
    """(namespace, other Tenant) for each namespace that this Tenant would claim and another already does."""
    mine = set(namespaces_claimed(spec, namespace_labels))
    out = []
    for other, other_spec in sorted(others.items()):
        if other == name:
            continue
        out.extend((ns, other) for ns in sorted(mine & set(namespaces_claimed(other_spec, namespace_labels))))
    return out


def selector_problems(selector: Mapping[str, Any] | None) -> list[str]:
    """What is wrong with a namespaceSelector's expressions, each naming the field, the value and the rule."""
    problems = []
    for i, req in enumerate((selector or {}).get("matchExpressions") or ()):
        field = f"spec.namespaceSelector.matchExpressions[{i}]"
        op, values = req.get("operator"), req.get("values") or []
        if op not in SELECTOR_OPERATORS:
            problems.append(f"{field}.operator is {op!r}; it must be one of {', '.join(SELECTOR_OPERATORS)}")
        elif op in ("In", "NotIn") and not values:
            problems.append(f"{field}.values is empty; operator {op} needs at least one value")
        elif op in ("Exists", "DoesNotExist") and values:
            problems.append(f"{field}.values has {len(values)} values; operator {op} takes none")
    return problems
