"""Watches of what the reconciler depends on besides the service: nodes (GPU types), namespaces
(labels a Tenant selects by) and Tenants (namespaces, quota). When one changes, the services it may
unblock, or move to another tenant, are synced again."""

from __future__ import annotations

import kopf

from flotilla.operator.api.v1alpha1 import GROUP, TENANT, VERSION, TenantSpec
from flotilla.operator.controllers import indexes
from flotilla.operator.controllers.indexes import labels_by_namespace
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.controllers.sync import retry_services
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
    # Quota or namespaces changed: services in its namespaces (or charged to it) are re-checked.
    rt: Runtime = memo.runtime
    try:
        tenant = TenantSpec.model_validate(spec or {})
    except ValueError:
        tenant = TenantSpec()
    labels = labels_by_namespace(kwargs["namespace_labels"])
    charged = {h.key for h in rt.held.entries(name)}

    def affected(obj: dict, cond: dict) -> bool:
        meta = obj["metadata"]
        ns = meta["namespace"]
        in_scope = claims(tenant, ns, labels.get(ns)) or (ns, meta["name"]) in charged
        return in_scope and cond.get(VALID) != "False"

    retry_services(rt, indexes.of(kwargs), affected, "tenant-changed")
