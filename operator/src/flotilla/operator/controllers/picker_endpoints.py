"""The picker's Service and EndpointSlice in each namespace with InferenceServices
(desired/picker_endpoints.py): planned from the indexes, server-side applied when the observed ones differ.

Triggers: an InferenceService's every event (created, changed, deleted, listed at start-up: its namespace),
a gateway pod's (every namespace: the slices list the gateway's pods), and the picker objects' own (their
namespace: drift, deletion, a Service someone else made). Removal is the garbage collector's (the objects'
owner references are the namespace's InferenceServices)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import kopf
from kubernetes.client.exceptions import ApiException

from flotilla.contract import GATEWAY_SERVICE
from flotilla.operator.clients.kube import api_error_message
from flotilla.operator.controllers import indexes
from flotilla.operator.controllers.indexes import (
    ISVC,
    in_gateway_namespace,
    index_all,
    index_firsts,
    is_picker_slice,
)
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.controllers.sync import going_away
from flotilla.operator.desired.picker_endpoints import GATEWAY_POD_LABELS, plan_all

log = logging.getLogger("flotilla.operator")


def sync_pickers(rt: Runtime, idx: dict, namespaces: Iterable[str] | None, trigger: str) -> None:
    """Bring the picker objects of `namespaces` (None: of every namespace with InferenceServices) in line."""
    with rt.picker_lock:
        plans = plan_all(
            index_all(idx["services"]),
            index_all(idx["gateway_pods"]),
            rt.config,
            index_firsts(idx["picker_services"]),
            index_firsts(idx["picker_slices"]),
            namespaces,
        )
        for picker in plans:
            if picker.foreign != (picker.namespace in rt.foreign_pickers):
                if picker.foreign:
                    rt.foreign_pickers.add(picker.namespace)
                    log.warning(
                        "namespace %s has a Service %s the operator did not make (without its labels, or with "
                        "a selector): left as it is; its InferencePools' ResolvedRefs report on it",
                        picker.namespace,
                        GATEWAY_SERVICE,
                    )
                else:
                    rt.foreign_pickers.discard(picker.namespace)
            for obj in picker.apply:
                _apply(rt, obj, trigger)


def _apply(rt: Runtime, obj: dict, trigger: str) -> None:
    meta = obj["metadata"]
    try:
        rt.kube.apply(obj)
        log.info("applied the picker's %s %s/%s (%s)", obj["kind"], meta["namespace"], meta["name"], trigger)
    except ApiException as exc:
        # The next event of the objects, a service or a gateway pod tries again.
        if exc.status == 404 or going_away(exc):
            log.info("picker %s in %s skipped: its namespace is going away", obj["kind"], meta["namespace"])
        else:
            log.warning(
                "picker %s %s/%s not applied: %s",
                obj["kind"],
                meta["namespace"],
                meta["name"],
                api_error_message(exc),
            )


def sync_pickers_logged(
    memo: kopf.Memo, kwargs: dict, namespaces: Iterable[str] | None, trigger: str
) -> None:
    try:
        sync_pickers(memo.runtime, indexes.of(kwargs), namespaces, trigger)
    except Exception:  # event handlers are not retried: the next event repairs
        log.exception("syncing the picker's Services (%s) failed", trigger)


@kopf.on.event(*ISVC)
def inference_service_event(namespace: str, memo: kopf.Memo, **kwargs) -> None:
    """A service came, changed, went or was listed: its namespace's objects and their owners."""
    sync_pickers_logged(memo, kwargs, [namespace], "inferenceservice")


@kopf.on.event("", "v1", "pods", labels=GATEWAY_POD_LABELS, when=in_gateway_namespace)
def gateway_pod_event(memo: kopf.Memo, **kwargs) -> None:
    """A gateway pod came, went, got its IP or changed readiness: every namespace's slice lists it."""
    sync_pickers_logged(memo, kwargs, None, "gateway-pod")


@kopf.on.event("discovery.k8s.io", "v1", "endpointslices", when=is_picker_slice)
def picker_slice_event(namespace: str, memo: kopf.Memo, **kwargs) -> None:
    """The slice was edited or deleted: re-applied while its namespace has services."""
    sync_pickers_logged(memo, kwargs, [namespace], "picker-slice")
