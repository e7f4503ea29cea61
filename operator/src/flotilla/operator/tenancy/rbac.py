"""What a Tenant's members may do, as Kubernetes objects. Pure.

From spec.members the operator derives, for each Tenant:
- in each of its namespaces, a RoleBinding of the shared ClusterRole `flotilla-tenant-member`
  (InferenceServices: all verbs; pods and their logs, events, the InferencePools the operator keeps for
  their services: read). Members get no verb on pods
  beyond reading, so GPU pods created directly cannot go around the quota;
- a ClusterRole and ClusterRoleBinding that let the members `get` their own Tenant, and nothing else
  of it (no update: members cannot edit their quota);
- in each namespace, a ResourceQuota on requests.nvidia.com/gpu as a backstop: the limits partition the
  tenant's total GPU quota over its namespaces (backstop.py), so the API server itself refuses GPU pods
  beyond that total, whoever creates them and in whichever of its namespaces.
Every object is owned by the Tenant (garbage-collected with it) and labelled with its name, so objects
of namespaces the Tenant no longer claims can be found and removed.
"""

from __future__ import annotations

from collections.abc import Mapping

from flotilla.operator.api import inference_extension as gie
from flotilla.operator.api.v1alpha1 import (
    API_VERSION,
    GROUP,
    INFERENCE_SERVICE,
    LORA_ADAPTER,
    TENANT,
    TenantSpec,
)
from flotilla.operator.naming import MANAGED_BY, MANAGED_BY_LABEL, TENANT_LABEL
from flotilla.operator.tenancy.backstop import namespace_limits, resource_quota

MEMBER_ROLE = "flotilla-tenant-member"
RBAC_API = "rbac.authorization.k8s.io/v1"

MEMBER_RULES = [
    {
        "apiGroups": [GROUP],
        "resources": [INFERENCE_SERVICE.plural, f"{INFERENCE_SERVICE.plural}/scale"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    },
    {"apiGroups": [GROUP], "resources": [f"{INFERENCE_SERVICE.plural}/status"], "verbs": ["get"]},
    {
        "apiGroups": [GROUP],
        "resources": [LORA_ADAPTER.plural],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    },
    {"apiGroups": [GROUP], "resources": [f"{LORA_ADAPTER.plural}/status"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["pods", "pods/log", "events"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["resourcequotas"], "verbs": ["get", "list"]},
    # The pools their HTTPRoutes reference; the operator owns them, so members may only read them.
    {"apiGroups": [gie.GROUP], "resources": [gie.PLURAL], "verbs": ["get", "list", "watch"]},
]


def member_cluster_role() -> dict:
    """Shared by every Tenant; shipped with the operator's RBAC (the operator may `bind` it)."""
    return {
        "apiVersion": RBAC_API,
        "kind": "ClusterRole",
        "metadata": {"name": MEMBER_ROLE, "labels": {MANAGED_BY_LABEL: MANAGED_BY}},
        "rules": MEMBER_RULES,
    }


def object_name(tenant: str) -> str:
    return f"flotilla-tenant-{tenant}"


def _meta(tenant: str, uid: str, namespace: str | None = None) -> dict:
    meta = {
        "name": object_name(tenant),
        "labels": {MANAGED_BY_LABEL: MANAGED_BY, TENANT_LABEL: tenant},
        "ownerReferences": [
            {"apiVersion": API_VERSION, "kind": TENANT.kind, "name": tenant, "uid": uid, "controller": True}
        ],
    }
    if namespace is not None:
        meta["namespace"] = namespace
    return meta


def subjects(spec: TenantSpec) -> list[dict]:
    out = []
    for member in spec.members:
        subject = {"kind": member.kind, "name": member.name}
        if member.kind == "ServiceAccount":
            subject["namespace"] = member.namespace or "default"
        else:
            subject["apiGroup"] = "rbac.authorization.k8s.io"
        out.append(subject)
    return out


def desired_objects(
    tenant: str,
    uid: str,
    spec: TenantSpec,
    namespaces: list[str],
    gpu_limits: Mapping[str, int] | None = None,
) -> list[dict]:
    """Objects to apply for the Tenant; `namespaces` are the ones it owns that exist; `gpu_limits` each
    one's backstop limit (backstop.py; default: the quota split with nothing held)."""
    members = subjects(spec)
    if gpu_limits is None:
        gpu_limits = namespace_limits(sum(spec.gpu_quota.values()), namespaces, {}, {})
    objects: list[dict] = [
        {
            "apiVersion": RBAC_API,
            "kind": "ClusterRole",
            "metadata": _meta(tenant, uid),
            "rules": [
                {
                    "apiGroups": [GROUP],
                    "resources": [TENANT.plural],
                    "resourceNames": [tenant],
                    "verbs": ["get"],
                }
            ],
        },
        {
            "apiVersion": RBAC_API,
            "kind": "ClusterRoleBinding",
            "metadata": _meta(tenant, uid),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": object_name(tenant),
            },
            "subjects": members,
        },
    ]
    for namespace in namespaces:
        objects.append(
            {
                "apiVersion": RBAC_API,
                "kind": "RoleBinding",
                "metadata": _meta(tenant, uid, namespace),
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": MEMBER_ROLE,
                },
                "subjects": members,
            }
        )
        objects.append(resource_quota(_meta(tenant, uid, namespace), gpu_limits.get(namespace, 0)))
    return objects


# What the operator itself needs for tenancy, merged into its RBAC by rbac.py: (apiGroup, resources,
# verbs, why), as in rbac.RULES.
OPERATOR_RULES: list[tuple[str, list[str], list[str], str]] = [
    (GROUP, [f"{TENANT.plural}/status"], ["get", "update", "patch"], "metering writes usage and cost"),
    (GROUP, [TENANT.plural], ["patch"], "kopf's finalizer and annotations for the metering daemons"),
    (
        "rbac.authorization.k8s.io",
        ["clusterroles", "clusterrolebindings", "rolebindings"],
        ["get", "list", "create", "patch", "delete"],
        "members' access to their namespaces and their own Tenant",
    ),
    ("", ["resourcequotas"], ["get", "list", "create", "patch", "delete"], "GPU backstop per namespace"),
    (
        "admissionregistration.k8s.io",
        ["validatingwebhookconfigurations", "mutatingwebhookconfigurations"],
        ["get", "list", "watch", "create", "patch"],
        "kopf keeps the webhook configuration (--webhook-port)",
    ),
]
# Binding the member role without holding its permissions; limited to that one role by name.
BIND_RULE = {
    "apiGroups": ["rbac.authorization.k8s.io"],
    "resources": ["clusterroles"],
    "resourceNames": [MEMBER_ROLE],
    "verbs": ["bind"],
}
# In the operator's own namespace only: the webhook's CA and serving certificate, and the admission
# webhook's quota reservations (one ConfigMap per Tenant, written with optimistic concurrency).
SECRET_RULES = [
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "update"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "create", "update"]},
]
