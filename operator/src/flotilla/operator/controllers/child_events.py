"""Events of the children the operator owns (Deployments, Services, PodDisruptionBudgets, InferencePools,
pods): correct drift by re-applying what changed, and refresh the owner's status. And of the Services the
InferencePools' endpointPickerRef names: their ports decide the pools' ResolvedRefs."""

from __future__ import annotations

import logging

import kopf

from flotilla.operator.controllers import indexes, picker_endpoints
from flotilla.operator.controllers.indexes import MANAGED, POOLS, index_one, is_picker_service, plain
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.controllers.sync import correct_drift, going_away, refresh_services, refresh_status
from flotilla.operator.desired.inference_pool import picker_ports
from flotilla.operator.naming import SERVICE_LABEL

log = logging.getLogger("flotilla.operator")


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
def deployment_event(event: dict, namespace: str, labels: dict, memo: kopf.Memo, **kwargs) -> None:
    _child_event(event, namespace, labels, memo, kwargs, check_drift=True)


@kopf.on.event("", "v1", "services", labels=MANAGED)
def k8s_service_event(event: dict, namespace: str, labels: dict, memo: kopf.Memo, **kwargs) -> None:
    _child_event(event, namespace, labels, memo, kwargs, check_drift=True)


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
def pdb_event(event: dict, namespace: str, labels: dict, memo: kopf.Memo, **kwargs) -> None:
    _child_event(event, namespace, labels, memo, kwargs, check_drift=True)


@kopf.on.event(*POOLS, labels=MANAGED)
def inference_pool_event(event: dict, namespace: str, labels: dict, memo: kopf.Memo, **kwargs) -> None:
    # Drift, and the pool's status: the operator's parent entry once the pool exists, and again when
    # another controller's write replaced the list.
    _child_event(event, namespace, labels, memo, kwargs, check_drift=True)


@kopf.on.event("", "v1", "services", when=is_picker_service)
def picker_service_event(event: dict, namespace: str, memo: kopf.Memo, **kwargs) -> None:
    """The Service the pools' endpointPickerRef names came, went or changed its ports: the pools of the
    namespace's services say so in ResolvedRefs."""
    rt: Runtime = memo.runtime
    body = None if event.get("type") == "DELETED" else event.get("object")
    # The operator's own Service there: re-applied when edited or deleted while the namespace has services.
    picker_endpoints.sync_pickers_logged(memo, kwargs, [namespace], "picker-service")
    ports = picker_ports(body)
    if namespace in rt.picker_ports and rt.picker_ports[namespace] == ports:
        return
    rt.picker_ports[namespace] = ports

    def in_namespace(obj: dict) -> bool:
        return obj["metadata"]["namespace"] == namespace and not obj["metadata"].get("deletionTimestamp")

    refresh_services(rt, indexes.of(kwargs), in_namespace, "picker-changed")


@kopf.on.event("", "v1", "pods", labels=MANAGED)
def pod_event(event: dict, namespace: str, labels: dict, memo: kopf.Memo, **kwargs) -> None:
    _child_event(event, namespace, labels, memo, kwargs, check_drift=False)


def _child_event(
    event: dict, namespace: str, labels: dict, memo: kopf.Memo, kwargs: dict, *, check_drift: bool
) -> None:
    if event.get("type") == "DELETED":
        # A deleted child of a live owner is re-created; with the owner gone, GC did it and it stays gone.
        check_drift = True
    owner = labels.get(SERVICE_LABEL)
    obj = index_one(kwargs["services"], (namespace, owner)) if owner else None
    if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
        return
    observed = plain(event.get("object") or {})
    if event.get("type") == "DELETED":
        observed = {"kind": observed.get("kind")}
    try:
        if check_drift:
            correct_drift(memo.runtime, obj, indexes.of(kwargs), "child", observed)
        else:
            refresh_status(memo.runtime, obj, indexes.of(kwargs), "child")
    except Exception as exc:
        _log_failure(exc, "refreshing %s/%s after a child event", namespace, owner)


def _log_failure(exc: Exception, what: str, *args) -> None:
    """Event-driven refreshes are not retried by kopf; the next event or resume repairs them. An owner or
    namespace that is going away is expected (watch events of different kinds arrive in any order)."""
    if getattr(exc, "status", None) == 404 or going_away(exc):
        log.info(what + " skipped: the object or its namespace is being deleted", *args)
    else:
        log.error(what + " failed: %s", *args, exc, exc_info=exc)
