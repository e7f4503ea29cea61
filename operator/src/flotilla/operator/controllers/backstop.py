"""The backstop's ResourceQuotas (tenancy/backstop.py partitions a Tenant's quota over its namespaces).

Two callers keep them: the metering round (with the Tenant's other access objects, tenant_access.py) and
the reconciler, which raises a namespace's limit before it grants a service there more GPUs, so that the
ReplicaSet's new pods never meet a limit the operator has not caught up with yet. Both compute the same
limits; each applies only what changed since either applied it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import kopf

from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.operator.clients.kube import APPLY, Kube
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.metrics import API_CALLS
from flotilla.operator.naming import FIELD_MANAGER, MANAGED_BY, MANAGED_BY_LABEL, TENANT_LABEL
from flotilla.operator.tenancy.backstop import namespace_limits, resource_quota
from flotilla.operator.tenancy.metering import pod_gpus
from flotilla.operator.tenancy.rbac import object_name

log = logging.getLogger("flotilla.operator.tenancy.backstop")

# The reconciler's own field manager for the limit alone: the metering round's apply (FIELD_MANAGER)
# also owns the ResourceQuota's owner reference, which this path does not know and must not remove.
RAISE_MANAGER = f"{FIELD_MANAGER}-backstop"
GONE = ("Succeeded", "Failed")


def limits(
    rt: Runtime, tenant: str, spec: TenantSpec, owned: list[str], gpu_pods: kopf.Index
) -> dict[str, int]:
    """Each existing owned namespace's GPU limit, from the reconciler's grants and the pods there now."""
    granted: dict[str, int] = {}
    for held in rt.held.entries(tenant):
        granted[held.key[0]] = granted.get(held.key[0], 0) + held.gpus
    in_use = {
        ns: sum(pod_gpus(p) for p in gpu_pods.get(ns, []) if (p.get("status") or {}).get("phase") not in GONE)
        for ns in owned
    }
    return namespace_limits(sum(spec.gpu_quota.values()), owned, granted, in_use)


def raise_limits(rt: Runtime, tenant: str, wanted: Mapping[str, int]) -> None:
    """Applies the limits that changed, lowered ones first (so the sum never passes the quota between
    two writes), under the reconciler's field manager."""
    changed = {ns: n for ns, n in wanted.items() if rt.backstop_limits.get(ns) != n}
    for ns, gpus in sorted(changed.items(), key=lambda item: item[1] - rt.backstop_limits.get(item[0], 0)):
        meta = {"name": object_name(tenant), "namespace": ns,
                "labels": {TENANT_LABEL: tenant, MANAGED_BY_LABEL: MANAGED_BY}}  # fmt: skip
        _apply(rt.kube, resource_quota(meta, gpus), RAISE_MANAGER)
        rt.backstop_limits[ns] = gpus
        log.info("tenant %s: namespace %s may request %d GPUs", tenant, ns, gpus)


def _apply(kube: Kube, obj: dict, manager: str) -> None:
    API_CALLS.labels(verb="apply", resource="ResourceQuota").inc()
    kube.core.patch_namespaced_resource_quota(
        obj["metadata"]["name"], obj["metadata"]["namespace"], obj,
        field_manager=manager, force=True, _content_type=APPLY,
    )  # fmt: skip
