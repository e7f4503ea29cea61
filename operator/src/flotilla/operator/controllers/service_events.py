"""An InferenceService's own handlers: reconcile it when it is created, changed or found at start-up;
forget it when it is deleted, and retry the services its freed quota may let through."""

from __future__ import annotations

import logging

import kopf

from flotilla.operator.controllers import indexes, sync
from flotilla.operator.controllers.indexes import ISVC, plain
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.controllers.sync import retry_services
from flotilla.operator.desired.status import QUOTA_ADMITTED
from flotilla.operator.metrics import SERVICES

log = logging.getLogger("flotilla.operator")


@kopf.on.resume(*ISVC)
@kopf.on.create(*ISVC)
@kopf.on.update(*ISVC)
def reconcile(body: kopf.Body, retry: int, memo: kopf.Memo, **kwargs) -> None:
    try:
        sync.reconcile(memo.runtime, plain(body), indexes.of(kwargs), "spec")
    except kopf.PermanentError:
        raise
    except Exception as exc:
        # Back off exponentially: a refusal that lasts (a full ClusterIP range, a quota) must not turn
        # every stuck service into a steady stream of API calls.
        delay = min(5 * 2 ** min(retry, 6), 300)
        raise kopf.TemporaryError(f"reconcile failed: {exc}", delay=delay) from exc


@kopf.on.event(*ISVC)
def service_event(event: dict, namespace: str, name: str, memo: kopf.Memo, **kwargs) -> None:
    if event.get("type") != "DELETED":
        return
    rt: Runtime = memo.runtime
    key = (namespace, name)
    with rt.lock:
        freed = rt.held.release(key)
        rt.written_status.pop(key, None)
        rt.refused.pop(key, None)
    SERVICES.forget(namespace, name)
    # Its quota reservation, if the webhook's ledger still holds one, frees its GPUs for the next create
    # now rather than when the reservation expires.
    uid = (kwargs.get("body") or {}).get("metadata", {}).get("uid") or ""
    try:
        memo.admission.release(key, uid)
    except Exception as exc:  # the reservation expires by itself; say why it lingers
        log.warning("could not release the quota reservation of %s/%s: %s", namespace, name, exc)
    if freed and freed.gpus:
        retry_services(rt, indexes.of(kwargs), _held_back_by_quota, "quota-freed")


def _held_back_by_quota(obj: dict, cond: dict[str, str]) -> bool:
    return cond.get(QUOTA_ADMITTED) == "False"
