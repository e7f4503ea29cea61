"""In-memory indexes, filled by kopf from watches before any handler runs, so that a reconcile reads no
API: nodes' GPU types, Tenants, namespaces' labels, InferenceServices, the Deployments, pods and
InferencePools the operator owns, the LoRAAdapters' names, the Services the pools' endpointPickerRef names,
the EndpointSlices the operator keeps for them and the gateway's pods those list. Also the readers that turn
an index into what the pure code wants."""

from __future__ import annotations

import logging

import kopf

from flotilla.contract import GATEWAY_SERVICE
from flotilla.operator.api import inference_extension as gie
from flotilla.operator.api.v1alpha1 import (
    GROUP,
    INFERENCE_SERVICE,
    LORA_ADAPTER,
    TENANT,
    VERSION,
    TenantSpec,
)
from flotilla.operator.desired.picker_endpoints import GATEWAY_POD_LABELS, SLICE_NAME
from flotilla.operator.naming import GPU_TYPE_LABEL, MANAGED_BY, MANAGED_BY_LABEL, SERVICE_LABEL

log = logging.getLogger("flotilla.operator")

ISVC = (GROUP, VERSION, INFERENCE_SERVICE.plural)
MANAGED = {MANAGED_BY_LABEL: MANAGED_BY}
POOLS = (gie.GROUP, gie.VERSION, gie.PLURAL)
NAMES = (
    "gpu_nodes",
    "tenants",
    "namespace_labels",
    "services",
    "deployments",
    "pods",
    "gpu_pods",
    "inference_pools",
    "picker_services",
    "picker_slices",
    "gateway_pods",
    "lora_adapter_names",
)


@kopf.index("", "v1", "nodes")
def gpu_nodes(name: str, labels: dict, **_) -> dict:
    gpu_type = labels.get(GPU_TYPE_LABEL)
    return {gpu_type: name} if gpu_type else {}


@kopf.index(GROUP, VERSION, TENANT.plural)
def tenants(name: str, spec: dict, **_) -> dict:
    return {name: dict(spec)}


@kopf.index("", "v1", "namespaces")
def namespace_labels(name: str, labels: dict, **_) -> dict:
    """Tenants claim namespaces by name and by label (spec.namespaceSelector)."""
    return {name: dict(labels)}


@kopf.index(*ISVC)
def services(namespace: str, name: str, body: kopf.Body, **_) -> dict:
    return {(namespace, name): plain(body)}


@kopf.index(GROUP, VERSION, LORA_ADAPTER.plural)
def lora_adapter_names(namespace: str, name: str, **_) -> dict:
    """The LoRAAdapters per namespace: metering keeps per-adapter usage for these only."""
    return {namespace: name}


@kopf.index("apps", "v1", "deployments", labels=MANAGED)
def deployments(namespace: str, labels: dict, body: kopf.Body, **_) -> dict:
    owner = labels.get(SERVICE_LABEL)
    return {(namespace, owner): plain(body)} if owner else {}


@kopf.index("", "v1", "pods", labels=MANAGED)
def pods(namespace: str, labels: dict, body: kopf.Body, **_) -> dict:
    owner = labels.get(SERVICE_LABEL)
    if not owner:
        return {}
    meta = {k: body.meta[k] for k in ("name", "deletionTimestamp") if body.meta.get(k)}
    return {(namespace, owner): {"metadata": meta, "status": plain(body.get("status") or {})}}


@kopf.index(*POOLS, labels=MANAGED)
def inference_pools(namespace: str, labels: dict, body: kopf.Body, **_) -> dict:
    """Watched only where the cluster serves the InferencePool CRD; without it, this stays empty."""
    owner = labels.get(SERVICE_LABEL)
    return {(namespace, owner): plain(body)} if owner else {}


def is_picker_service(name: str, **_) -> bool:
    """The Service the InferencePools' endpointPickerRef names (the reference is namespace-local: a
    Service of this name in each pool's namespace)."""
    return name == GATEWAY_SERVICE


@kopf.index("", "v1", "services", when=is_picker_service)
def picker_services(namespace: str, meta: dict, spec: dict, **_) -> dict:
    """Its ports (the pools' ResolvedRefs), and whether the operator made it (desired/picker_endpoints.py:
    its labels, owners and selector)."""
    return {
        namespace: {
            "metadata": {k: plain(meta[k]) for k in ("labels", "ownerReferences") if meta.get(k)},
            "spec": {k: plain(spec[k]) for k in ("type", "ports", "selector") if spec.get(k)},
        }
    }


def is_picker_slice(name: str, **_) -> bool:
    """The EndpointSlice the operator keeps beside each namespace's picker Service."""
    return name == SLICE_NAME


@kopf.index("discovery.k8s.io", "v1", "endpointslices", when=is_picker_slice)
def picker_slices(namespace: str, body: kopf.Body, **_) -> dict:
    return {namespace: plain(body)}


def in_gateway_namespace(namespace: str, memo: kopf.Memo, **_) -> bool:
    """The gateway's pods are those of its namespace (the operator's, --operator-namespace)."""
    return namespace == memo.runtime.config.gateway_namespace


@kopf.index("", "v1", "pods", labels=GATEWAY_POD_LABELS, when=in_gateway_namespace)
def gateway_pods(name: str, body: kopf.Body, **_) -> dict:
    """What the picker's EndpointSlices list of each gateway pod: its IPs, node, readiness, whether it is
    terminating."""
    status = body.get("status") or {}
    return {
        name: {
            "metadata": {k: body.meta[k] for k in ("name", "deletionTimestamp") if body.meta.get(k)},
            "spec": {"nodeName": (body.get("spec") or {}).get("nodeName")},
            "status": {
                k: plain(status[k]) for k in ("phase", "podIP", "podIPs", "conditions") if k in status
            },
        }
    }


# ---------------------------------------------------------------------------------------------------
# Readers


def of(kwargs: dict) -> dict:
    """The indexes among a handler's keyword arguments (kopf passes each by its function's name)."""
    return {name: kwargs.get(name, {}) for name in NAMES}


def plain(value):
    """kopf bodies are read-only views; plan wants plain data (without managedFields' bulk)."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: plain(v) for k, v in value.items() if k != "managedFields"}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def index_all(index: kopf.Index) -> list[dict]:
    return [obj for store in index.values() for obj in store]


def index_firsts(index: kopf.Index) -> dict:
    """One object per key (the indexes of one object per key: per namespace, per name)."""
    return {key: obj for key in list(index) if (obj := index_one(index, key)) is not None}


def index_one(index: kopf.Index, key) -> dict | None:
    store = index.get(key)
    return next(iter(store), None) if store is not None else None


def labels_by_namespace(index: kopf.Index) -> dict[str, dict]:
    return {name: next(iter(store), {}) for name, store in index.items()}


def tenant_specs(tenants: kopf.Index) -> dict[str, TenantSpec]:
    specs = {}
    for name, store in tenants.items():
        for raw in store:
            try:
                specs[name] = TenantSpec.model_validate(raw)
            except ValueError as exc:  # a Tenant the schema let through but we cannot read
                log.warning("ignoring Tenant %s: %s", name, exc)
    return specs
