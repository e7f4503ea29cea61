"""Names and labels shared by the desired state, the watches and RBAC: one definition each."""

from __future__ import annotations

from flotilla.contract import GPU_RESOURCE as GPU_RESOURCE
from flotilla.contract import GPU_TYPE_LABEL as GPU_TYPE_LABEL

FIELD_MANAGER = "flotilla"

SERVICE_LABEL = "flotilla.dev/inferenceservice"  # the pod selector; immutable on a Deployment
TENANT_LABEL = "flotilla.dev/tenant"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "flotilla"

# On every engine pod while it lives: the operator removes it once it has metered the pod's end, so a pod
# that ends while no operator runs is still there, with its end, for the next operator (tenancy/metering.py).
METERING_FINALIZER = "flotilla.dev/metering"

NO_TENANT = ""  # FLOTILLA_TENANT's value when no Tenant claims the namespace


def selector_labels(service: str) -> dict[str, str]:
    return {SERVICE_LABEL: service}


def child_labels(service: str, tenant: str) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "flotilla-engine",
        "app.kubernetes.io/instance": service,
        MANAGED_BY_LABEL: MANAGED_BY,
        **selector_labels(service),
    }
    if tenant:
        labels[TENANT_LABEL] = tenant
    return labels


def selector_string(service: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(service).items())
