"""A Tenant's access objects: the RoleBindings, ClusterRole(Binding)s and ResourceQuotas that
tenancy/rbac.py derives from its spec, applied server-side and removed from namespaces it gave up.
Called by the metering daemon each round; applies only when the objects changed."""

from __future__ import annotations

import hashlib
import json
import logging

from kubernetes import client

from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.operator.clients.kube import APPLY, Kube
from flotilla.operator.metrics import API_CALLS
from flotilla.operator.naming import FIELD_MANAGER, TENANT_LABEL
from flotilla.operator.tenancy import rbac as tenant_rbac

log = logging.getLogger("flotilla.operator.tenancy.rules")


def sync_objects(
    kube: Kube,
    applied: dict[str, str],
    name: str,
    uid: str,
    spec: TenantSpec,
    owned: list[str],
    labels: dict,
    gpu_limits: dict[str, int],
) -> None:
    """Apply the Tenant's RBAC and ResourceQuota in the namespaces it owns (flotilla.ownership: claimed by
    it alone) that exist, if they changed since `applied` (tenant -> digest) says they were last applied,
    and remove them from namespaces it no longer owns."""
    existing = [ns for ns in owned if ns in labels]
    objects = tenant_rbac.desired_objects(name, uid, spec, existing, gpu_limits)
    digest = hashlib.sha256(json.dumps(objects, sort_keys=True).encode()).hexdigest()
    if applied.get(name) == digest:
        return
    rbac = client.RbacAuthorizationV1Api(kube.custom.api_client)
    apply = {
        "ClusterRole": lambda o: rbac.patch_cluster_role(o["metadata"]["name"], o, **_ssa()),
        "ClusterRoleBinding": lambda o: rbac.patch_cluster_role_binding(o["metadata"]["name"], o, **_ssa()),
        "RoleBinding": lambda o: rbac.patch_namespaced_role_binding(
            o["metadata"]["name"], o["metadata"]["namespace"], o, **_ssa()
        ),
        "ResourceQuota": lambda o: kube.core.patch_namespaced_resource_quota(
            o["metadata"]["name"], o["metadata"]["namespace"], o, **_ssa()
        ),
    }
    for obj in objects:
        API_CALLS.labels(verb="apply", resource=obj["kind"]).inc()
        apply[obj["kind"]](obj)
    # Namespaces the Tenant no longer claims lose its RoleBinding and ResourceQuota.
    selector = f"{TENANT_LABEL}={name}"
    keep = set(existing)
    for item in rbac.list_role_binding_for_all_namespaces(label_selector=selector).items:
        if item.metadata.namespace not in keep:
            rbac.delete_namespaced_role_binding(item.metadata.name, item.metadata.namespace)
    for item in kube.core.list_resource_quota_for_all_namespaces(label_selector=selector).items:
        if item.metadata.namespace not in keep:
            kube.core.delete_namespaced_resource_quota(item.metadata.name, item.metadata.namespace)
    applied[name] = digest
    log.info(
        "tenant %s: applied RBAC and ResourceQuota for namespaces %s", name, ", ".join(existing) or "none"
    )


def _ssa() -> dict:
    return {"field_manager": FIELD_MANAGER, "force": True, "_content_type": APPLY}
