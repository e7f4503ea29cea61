"""Which namespaces a Tenant claims, and what is wrong with a Tenant. Pure.

A Tenant claims namespaces by name (spec.namespaces) and by labels (spec.namespaceSelector). A
namespace claimed by two Tenants has no single quota, so such a Tenant is refused at admission.
"""

from __future__ import annotations

from collections.abc import Mapping

from flotilla.operator.api.v1alpha1 import TenantSpec

NamespaceLabels = Mapping[str, Mapping[str, str]]  # namespace -> its labels


def claims(spec: TenantSpec, namespace: str, labels: Mapping[str, str] | None) -> bool:
    if namespace in spec.namespaces:
        return True
    selector = spec.namespace_selector
    if selector is None or not selector.match_labels or labels is None:
        return False
    return all(labels.get(k) == v for k, v in selector.match_labels.items())


def tenant_of(
    namespace: str, tenants: Mapping[str, TenantSpec], namespaces: NamespaceLabels | None = None
) -> str | None:
    """The Tenant that claims the namespace; the first by name if (wrongly) several do."""
    labels = (namespaces or {}).get(namespace)
    owners = sorted(name for name, spec in tenants.items() if claims(spec, namespace, labels))
    return owners[0] if owners else None


def namespaces_of(spec: TenantSpec, namespaces: NamespaceLabels) -> list[str]:
    """Every namespace the Tenant claims: those listed (existing or not) and the existing ones selected."""
    found = set(spec.namespaces)
    found.update(ns for ns, labels in namespaces.items() if claims(spec, ns, labels))
    return sorted(found)


def tenant_problems(
    name: str, spec: TenantSpec, others: Mapping[str, TenantSpec], namespaces: NamespaceLabels
) -> list[str]:
    """Why this Tenant cannot be accepted next to the others (an empty list: it can).

    Negative quotas and prices never get here: the CRD schema (minimum 0) refuses them first."""
    problems = []
    mine = set(namespaces_of(spec, namespaces))
    for other, other_spec in sorted(others.items()):
        if other == name:
            continue
        shared = sorted(mine & set(namespaces_of(other_spec, namespaces)))
        if shared:
            problems.append(
                f"tenant {name}: namespace {', '.join(shared)} already belongs to tenant {other}; "
                "a namespace can belong to one tenant only"
            )
    unpriced = sorted(set(spec.price_per_gpu_hour) - set(spec.gpu_quota))
    if unpriced:
        problems.append(
            f"tenant {name}: pricePerGPUHour names {', '.join(unpriced)}, which gpuQuota does not; "
            f"quota covers: {', '.join(sorted(spec.gpu_quota)) or 'none'}"
        )
    return problems


def scheduling_weights(tenants: Mapping[str, TenantSpec]) -> tuple[tuple[str, float], ...]:
    """The fair policy's tenant weights: every Tenant whose schedulingWeight is not 1 (the engine weighs
    the others 1), sorted by name so that the same Tenants always render the same engine command."""
    return tuple(
        (name, spec.scheduling_weight)
        for name, spec in sorted(tenants.items())
        if spec.scheduling_weight != 1
    )
