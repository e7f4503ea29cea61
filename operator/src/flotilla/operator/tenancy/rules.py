"""The operator's side of tenancy rules: the Tenant models handed to flotilla.ownership (the one rule for
which Tenant owns a namespace, shared with the gateway), and what else is wrong with a Tenant. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from flotilla import ownership
from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.ownership import NamespaceLabels, Owner


def _stored(tenants: Mapping[str, TenantSpec]) -> dict[str, dict]:
    return {name: spec.to_wire() for name, spec in tenants.items()}


def owner_of(namespace: str, tenants: Mapping[str, TenantSpec], namespaces: NamespaceLabels) -> Owner:
    return ownership.owner_of(namespace, _stored(tenants), namespaces)


def tenant_of(
    namespace: str, tenants: Mapping[str, TenantSpec], namespaces: NamespaceLabels | None = None
) -> str | None:
    """The Tenant that owns the namespace; None when no Tenant, or more than one, claims it."""
    return owner_of(namespace, tenants, namespaces or {}).tenant


def claims(spec: TenantSpec, namespace: str, labels: Mapping[str, str] | None) -> bool:
    return ownership.claims(spec.to_wire(), namespace, labels)


def namespaces_owned(name: str, tenants: Mapping[str, TenantSpec], namespaces: NamespaceLabels) -> list[str]:
    """The namespaces the Tenant claims that no other Tenant claims too (where it holds RBAC and quota)."""
    return ownership.namespaces_owned(name, _stored(tenants), namespaces)


def contested(tenants: Mapping[str, TenantSpec], namespaces: NamespaceLabels) -> list[Owner]:
    """Every namespace two or more Tenants claim (none of them owns it)."""
    return ownership.contested(_stored(tenants), namespaces)


def tenant_problems(
    name: str, spec: TenantSpec, others: Mapping[str, TenantSpec], namespaces: NamespaceLabels
) -> list[str]:
    """Why this Tenant cannot be accepted next to the others (an empty list: it can).

    Negative quotas and prices never get here: the CRD schema (minimum 0) refuses them first."""
    problems = [
        f"tenant {name}: namespace {ns} already belongs to tenant {other}; a namespace can belong to one "
        "tenant only"
        for ns, other in ownership.conflicts(name, spec.to_wire(), _stored(others), namespaces)
    ]
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
