"""kopf handlers: the thin shell around reconcile.plan.

What they do, and nothing more:
- keep in-memory indexes (fed by watches) of nodes' GPU types, Tenants, InferenceServices and the
  Deployments and pods the operator owns, so that a reconcile reads no API;
- on an InferenceService create/update/resume, gather a World, call `plan`, server-side apply the
  children, write status when it changed, post the plan's events;
- on events of owned children, correct drift (re-apply) and refresh the owner's status;
- when nodes, Tenants or other services change, retry services that are invalid or held back by quota.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import kopf
from kubernetes.client.exceptions import ApiException

from flotilla.operator.api.v1alpha1 import GROUP, INFERENCE_SERVICE, TENANT, VERSION, TenantSpec
from flotilla.operator.clients.kube import Kube, api_error_message
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.drift import drifted
from flotilla.operator.desired.reconcile import Event, Plan, World, plan, status_changed
from flotilla.operator.desired.status import QUOTA_ADMITTED, VALID, with_apply_failures
from flotilla.operator.metrics import HEALTH, RECONCILE_DURATION, RECONCILE_ERRORS, RECONCILES
from flotilla.operator.naming import GPU_TYPE_LABEL, MANAGED_BY, MANAGED_BY_LABEL, SERVICE_LABEL
from flotilla.operator.tenancy.quota import Grant
from flotilla.operator.tenancy.rules import claims, tenant_of

log = logging.getLogger("flotilla.operator")

ISVC = (GROUP, VERSION, INFERENCE_SERVICE.plural)
MANAGED = {MANAGED_BY_LABEL: MANAGED_BY}
Key = tuple[str, str]  # (namespace, InferenceService name)


@dataclass
class Runtime:
    """Process-wide state the handlers share. Set by runner.py before kopf starts."""

    config: OperatorConfig
    kube: Kube
    peering_name: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    grants: dict[Key, Grant] = field(default_factory=dict)  # quota ledger: what each service holds
    grants_seeded: bool = False
    written_status: dict[Key, dict] = field(
        default_factory=dict
    )  # last status we wrote, newer than the index
    refused: dict[Key, dict[str, str]] = field(default_factory=dict)  # kind -> why the API refused it
    key_locks: dict[Key, threading.Lock] = field(default_factory=dict)  # one sync at a time per service
    gpu_types: frozenset[str] = frozenset()
    namespace_labels: dict[str, dict] = field(default_factory=dict)  # as last seen, to spot label changes


RUNTIME: Runtime | None = None


def runtime() -> Runtime:
    if RUNTIME is None:
        raise RuntimeError(
            "flotilla.operator.controllers.services.RUNTIME is not set; start through `flotilla operator run`"
        )
    return RUNTIME


# ---------------------------------------------------------------------------------------------------
# Lifecycle


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    # Handler progress lives in annotations: status belongs to the API (and its schema prunes kopf's).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Events only for what we post ourselves and real warnings, not one per handler run.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 16
    settings.watching.server_timeout = 300
    settings.peering.name = runtime().peering_name or settings.peering.name
    HEALTH.set(True)


@kopf.on.login()
def login(**_) -> kopf.ConnectionInfo:
    """kopf talks to the API with the same credentials as our client (one kubeconfig, loaded once)."""
    cfg = runtime().kube.configuration
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme=scheme or ("Bearer" if token else None),
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


@kopf.on.cleanup()
def stopping(**_) -> None:
    HEALTH.set(False)


# ---------------------------------------------------------------------------------------------------
# Indexes (kopf fills them from watches before any handler runs)


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


def labels_by_namespace(index: kopf.Index) -> dict[str, dict]:
    return {name: next(iter(store), {}) for name, store in index.items()}


@kopf.index(*ISVC)
def services(namespace: str, name: str, body: kopf.Body, **_) -> dict:
    return {(namespace, name): _plain(body)}


@kopf.index("apps", "v1", "deployments", labels=MANAGED)
def deployments(namespace: str, labels: dict, body: kopf.Body, **_) -> dict:
    owner = labels.get(SERVICE_LABEL)
    return {(namespace, owner): _plain(body)} if owner else {}


@kopf.index("", "v1", "pods", labels=MANAGED)
def pods(namespace: str, labels: dict, body: kopf.Body, **_) -> dict:
    owner = labels.get(SERVICE_LABEL)
    if not owner:
        return {}
    meta = {k: body.meta[k] for k in ("name", "deletionTimestamp") if body.meta.get(k)}
    return {(namespace, owner): {"metadata": meta, **_pick(body, "status")}}


def _pick(body: kopf.Body, *keys: str) -> dict:
    return {k: _plain(body.get(k) or {}) for k in keys}


def _plain(value):
    """kopf bodies are read-only views; plan wants plain data (without managedFields' bulk)."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items() if k != "managedFields"}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def index_one(index: kopf.Index, key) -> dict | None:
    store = index.get(key)
    return next(iter(store), None) if store is not None else None


# ---------------------------------------------------------------------------------------------------
# Reconcile


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seed_grants(rt: Runtime, services: kopf.Index, tenants: kopf.Index, namespaces: kopf.Index) -> None:
    """After a restart, the ledger starts from what services' status says they were granted."""
    specs, labels = tenant_specs(tenants), labels_by_namespace(namespaces)
    for key, store in services.items():
        for obj in store:
            spec, status = obj.get("spec") or {}, obj.get("status") or {}
            resources = spec.get("resources") or {}
            tenant = tenant_of(key[0], specs, labels) or ""
            held = status.get("desiredReplicas", 0) * resources.get("gpus", 1)
            rt.grants.setdefault(key, Grant(tenant, resources.get("gpuType"), held))
    rt.grants_seeded = True


def tenant_specs(tenants: kopf.Index) -> dict[str, TenantSpec]:
    specs = {}
    for name, store in tenants.items():
        for raw in store:
            try:
                specs[name] = TenantSpec.model_validate(raw)
            except ValueError as exc:  # a Tenant the schema let through but we cannot read
                log.warning("ignoring Tenant %s: %s", name, exc)
    return specs


def _plan(obj: dict, indexes: dict) -> tuple[Plan, Key]:
    rt = runtime()
    meta = obj["metadata"]
    key = (meta["namespace"], meta["name"])
    written = rt.written_status.get(key)
    if written is not None:
        # Our own last write may be newer than the watch has delivered; transition times come from it.
        obj = {**obj, "status": written}
    with rt.lock:
        if not rt.grants_seeded:
            _seed_grants(rt, indexes["services"], indexes["tenants"], indexes["namespace_labels"])
        world = World(
            config=rt.config,
            now=_now(),
            gpu_types=set(indexes["gpu_nodes"].keys()),
            tenants=tenant_specs(indexes["tenants"]),
            namespace_labels=labels_by_namespace(indexes["namespace_labels"]),
            other_grants=[g for k, g in rt.grants.items() if k != key],
            deployment=index_one(indexes["deployments"], key),
            pods=list(indexes["pods"].get(key, [])),
            path_exists=os.path.isdir if rt.config.check_local_model_paths else None,
        )
        result = plan(obj, world)
        if result.grant is not None:
            rt.grants[key] = result.grant
    return result, key


class ApplyFailed(Exception):
    pass


def _write(obj: dict, result: Plan, key: Key, *, apply: Iterable[dict]) -> None:
    rt = runtime()
    # Remembered until that kind is applied successfully, so status does not flip back and forth
    # between refreshes that re-apply nothing.
    refused = rt.refused.setdefault(key, {})
    for child in apply:
        try:
            rt.kube.apply(child)
            refused.pop(child["kind"], None)
        except ApiException as exc:
            if exc.status == 404 or _going_away(exc):
                raise
            refused[child["kind"]] = f"{child['kind']} {key[1]}: {api_error_message(exc)}"
    failures = list(refused.values()) if result.children else []
    status, events = result.status, list(result.events)
    if failures:
        status = with_apply_failures(status, failures, _now())
        before = rt.written_status.get(key, obj.get("status")) or {}
        if before.get("message") != status["message"]:
            events.append(Event("Warning", "ApplyFailed", status["message"]))
    current = rt.written_status.get(key, obj.get("status"))
    if status_changed(current, status):
        rt.kube.patch_status(key[0], key[1], status)
        rt.written_status[key] = status
    for event in events:
        kopf.event(obj, type=event.type, reason=event.reason, message=event.message[:1000])
    if failures and any(child["kind"] in refused for child in apply):
        raise ApplyFailed("; ".join(failures))


def _key_lock(key: Key) -> threading.Lock:
    rt = runtime()
    with rt.lock:
        return rt.key_locks.setdefault(key, threading.Lock())


def _to_apply(result: Plan, mode: str, observed: dict | None, indexed_deployment: dict | None) -> list[dict]:
    """Which desired children to send. Applying is idempotent; this only saves calls."""
    if mode == "full":
        return result.children
    if mode == "drift":  # one child changed (or vanished): re-apply it if it no longer matches
        assert observed is not None
        return [c for c in result.children if c["kind"] == observed.get("kind") and drifted(observed, c)]
    # "retry": the world changed; the Deployment carries what a retry can change (replicas, tenant label)
    if indexed_deployment is None:
        return result.children
    return [c for c in result.children if c["kind"] == "Deployment" and drifted(indexed_deployment, c)]


def sync(obj: dict, indexes: dict, trigger: str, *, mode: str = "full", observed: dict | None = None) -> Plan:
    """Plan one service and carry the plan out (see _to_apply for the modes)."""
    meta = obj["metadata"]
    key = (meta["namespace"], meta["name"])
    RECONCILES.labels(trigger).inc()
    with _key_lock(key), RECONCILE_DURATION.labels(trigger).time():
        try:
            result, key = _plan(obj, indexes)
            to_apply = _to_apply(result, mode, observed, index_one(indexes["deployments"], key))
            if mode == "drift" and to_apply:
                log.info(
                    "correcting drift of %s %s/%s: %s",
                    observed.get("kind"),
                    *key,
                    drifted(observed, to_apply[0]),
                )
            _write(obj, result, key, apply=to_apply)
            return result
        except Exception:
            RECONCILE_ERRORS.labels(trigger).inc()
            raise


@kopf.on.resume(*ISVC)
@kopf.on.create(*ISVC)
@kopf.on.update(*ISVC)
def reconcile(body: kopf.Body, retry: int, **kwargs) -> None:
    try:
        sync(_plain(body), _indexes(kwargs), "spec")
    except kopf.PermanentError:
        raise
    except Exception as exc:
        # Back off exponentially: a refusal that lasts (a full ClusterIP range, a quota) must not turn
        # every stuck service into a steady stream of API calls.
        delay = min(5 * 2 ** min(retry, 6), 300)
        raise kopf.TemporaryError(f"reconcile failed: {exc}", delay=delay) from exc


def _indexes(kwargs: dict) -> dict:
    return {
        name: kwargs[name]
        for name in ("gpu_nodes", "tenants", "namespace_labels", "services", "deployments", "pods")
    }


@kopf.on.event(*ISVC)
def service_event(event: dict, namespace: str, name: str, **kwargs) -> None:
    if event.get("type") != "DELETED":
        return
    rt = runtime()
    with rt.lock:
        freed = rt.grants.pop((namespace, name), None)
        rt.written_status.pop((namespace, name), None)
        rt.refused.pop((namespace, name), None)
    if freed and freed.gpus:
        _retry(kwargs, lambda obj, cond: cond.get(QUOTA_ADMITTED) == "False", "quota-freed")


# ---------------------------------------------------------------------------------------------------
# Children: drift and status


def _owner_obj(namespace: str, labels: dict, kwargs: dict) -> dict | None:
    owner = labels.get(SERVICE_LABEL)
    return index_one(kwargs["services"], (namespace, owner)) if owner else None


def _child_event(event: dict, namespace: str, labels: dict, kwargs: dict, *, check_drift: bool) -> None:
    if event.get("type") == "DELETED":
        # A deleted child of a live owner is re-created; with the owner gone, GC did it and it stays gone.
        check_drift = True
    obj = _owner_obj(namespace, labels, kwargs)
    if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
        return
    observed = _plain(event.get("object") or {})
    if event.get("type") == "DELETED":
        observed = {"kind": observed.get("kind")}
    try:
        sync(obj, _indexes(kwargs), "child", mode="drift", observed=observed if check_drift else {})
    except Exception as exc:
        _log_failure(exc, "refreshing %s/%s after a child event", namespace, labels.get(SERVICE_LABEL))


def _going_away(exc: Exception) -> bool:
    return getattr(exc, "status", None) == 403 and "being terminated" in str(getattr(exc, "body", ""))


def _log_failure(exc: Exception, what: str, *args) -> None:
    """Event-driven refreshes are not retried by kopf; the next event or resume repairs them. An owner or
    namespace that is going away is expected (watch events of different kinds arrive in any order)."""
    if getattr(exc, "status", None) == 404 or _going_away(exc):
        log.info(what + " skipped: the object or its namespace is being deleted", *args)
    else:
        log.error(what + " failed: %s", *args, exc, exc_info=exc)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
def deployment_event(event: dict, namespace: str, labels: dict, **kwargs) -> None:
    _child_event(event, namespace, labels, kwargs, check_drift=True)


@kopf.on.event("", "v1", "services", labels=MANAGED)
def k8s_service_event(event: dict, namespace: str, labels: dict, **kwargs) -> None:
    _child_event(event, namespace, labels, kwargs, check_drift=True)


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
def pdb_event(event: dict, namespace: str, labels: dict, **kwargs) -> None:
    _child_event(event, namespace, labels, kwargs, check_drift=True)


@kopf.on.event("", "v1", "pods", labels=MANAGED)
def pod_event(event: dict, namespace: str, labels: dict, **kwargs) -> None:
    _child_event(event, namespace, labels, kwargs, check_drift=False)


# ---------------------------------------------------------------------------------------------------
# The world changed: retry the services it may unblock


def _conditions(obj: dict) -> dict[str, str]:
    return {c.get("type"): c.get("status") for c in (obj.get("status") or {}).get("conditions") or []}


def _retry(kwargs: dict, wanted, trigger: str) -> None:
    indexes = _indexes(kwargs)
    for store in list(kwargs["services"].values()):
        for obj in store:
            if wanted(obj, _conditions(obj)):
                try:
                    sync(obj, indexes, trigger, mode="retry")
                except Exception:
                    log.exception(
                        "retrying %s/%s failed", obj["metadata"]["namespace"], obj["metadata"]["name"]
                    )


@kopf.on.event("", "v1", "nodes")
def node_event(gpu_nodes: kopf.Index, **kwargs) -> None:
    rt = runtime()
    types = frozenset(gpu_nodes.keys())
    if types == rt.gpu_types:
        return
    rt.gpu_types = types
    _retry({**kwargs, "gpu_nodes": gpu_nodes}, lambda obj, cond: cond.get(VALID) == "False", "nodes-changed")


@kopf.on.event("", "v1", "namespaces")
def namespace_event(name: str, labels: dict, **kwargs) -> None:
    # A label change can move a namespace into (or out of) a Tenant's namespaceSelector.
    rt = runtime()
    labels = dict(labels or {})
    previous = rt.namespace_labels.get(name)
    rt.namespace_labels[name] = labels
    if previous is None or previous == labels:
        return
    _retry(kwargs, lambda obj, cond: obj["metadata"]["namespace"] == name, "namespace-labels-changed")


@kopf.on.event(GROUP, VERSION, TENANT.plural)
def tenant_event(name: str, spec: dict, **kwargs) -> None:
    # Quota or namespaces changed: services in its namespaces (or charged to it) are re-checked.
    rt = runtime()
    try:
        tenant = TenantSpec.model_validate(spec or {})
    except ValueError:
        tenant = TenantSpec()
    labels = labels_by_namespace(kwargs["namespace_labels"])
    charged = {k for k, g in rt.grants.items() if g.tenant == name}

    def affected(obj: dict, cond: dict) -> bool:
        meta = obj["metadata"]
        ns = meta["namespace"]
        in_scope = claims(tenant, ns, labels.get(ns)) or (ns, meta["name"]) in charged
        return in_scope and cond.get(VALID) != "False"

    _retry(kwargs, affected, "tenant-changed")
