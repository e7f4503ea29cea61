"""Watches of what the reconciler depends on besides the service: nodes (GPU types), namespaces
(labels a Tenant selects by) and Tenants (namespaces, quota, scheduling weight). When one changes, the
services it may unblock, or move to another tenant, or whose engine command carries its weight, are
synced again."""

from __future__ import annotations

import kopf

from flotilla.operator.api.v1alpha1 import GROUP, TENANT, VERSION, TenantSpec
from flotilla.operator.controllers import indexes
from flotilla.operator.controllers.indexes import labels_by_namespace
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.controllers.sync import retry_services
from flotilla.operator.desired.reconcile import uses_tenant_weights
from flotilla.operator.desired.status import VALID
from flotilla.operator.tenancy.rules import claims


@kopf.on.event("", "v1", "nodes")
def node_event(memo: kopf.Memo, **kwargs) -> None:
    rt: Runtime = memo.runtime
    types = frozenset(kwargs["gpu_nodes"].keys())
    if types == rt.gpu_types:
        return
    rt.gpu_types = types
    retry_services(rt, indexes.of(kwargs), _invalid, "nodes-changed")


def _invalid(obj: dict, cond: dict[str, str]) -> bool:
    return cond.get(VALID) == "False"


@kopf.on.event("", "v1", "namespaces")
def namespace_event(name: str, labels: dict, memo: kopf.Memo, **kwargs) -> None:
    # A label change can move a namespace into (or out of) a Tenant's namespaceSelector.
    rt: Runtime = memo.runtime
    labels = dict(labels or {})
    previous = rt.namespace_labels.get(name)
    rt.namespace_labels[name] = labels
    if previous is None or previous == labels:
        return

    def in_namespace(obj: dict, cond: dict[str, str]) -> bool:
        return obj["metadata"]["namespace"] == name

    retry_services(rt, indexes.of(kwargs), in_namespace, "namespace-labels-changed")


@kopf.on.event(GROUP, VERSION, TENANT.plural)
def tenant_event(name: str, spec: dict, memo: kopf.Memo, **kwargs) -> None:
    # Quota or namespaces changed: services in its namespaces (or charged to it) are re-checked. A changed
    # schedulingWeight (a Tenant created or deleted with a weight other than 1 included) is in the command
    # of every fair engine, whatever its namespace: those are re-planned too.
    rt: Runtime = memo.runtime
    try:
        tenant = TenantSpec.model_validate(spec or {})
    except ValueError:
        tenant = TenantSpec()
    labels = labels_by_namespace(kwargs["namespace_labels"])
    charged = {h.key for h in rt.held.entries(name)}
    deleted = kwargs.get("type") == "DELETED"
    weight = 1.0 if deleted else tenant.scheduling_weight
    weight_changed = rt.tenant_weights.get(name, 1.0) != weight
    if deleted:
        rt.tenant_weights.pop(name, None)
    else:
        rt.tenant_weights[name] = weight

    def affected(obj: dict, cond: dict) -> bool:
        meta = obj["metadata"]
        ns = meta["namespace"]
        in_scope = claims(tenant, ns, labels.get(ns)) or (ns, meta["name"]) in charged
        return (in_scope or weight_changed and uses_tenant_weights(obj)) and cond.get(VALID) != "False"

    retry_services(rt, indexes.of(kwargs), affected, "tenant-changed")
