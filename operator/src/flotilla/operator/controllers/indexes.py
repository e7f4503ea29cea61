"""In-memory indexes, filled by kopf from watches before any handler runs, so that a reconcile reads no
API: nodes' GPU types, Tenants, namespaces' labels, InferenceServices, the Deployments, pods and
InferencePools the operator owns, the LoRAAdapters' names, and the Services the pools' endpointPickerRef names. Also the readers
that turn an index into what the pure code wants."""

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
def picker_services(namespace: str, spec: dict, **_) -> dict:
    ports = [{"port": p.get("port")} for p in spec.get("ports") or []]
    return {namespace: {"spec": {"ports": ports}}}


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
