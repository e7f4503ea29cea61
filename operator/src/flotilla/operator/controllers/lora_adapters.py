"""LoRAAdapter handlers: load each adapter into every ready replica of its base InferenceService, keep it
there, and unload it when the object goes (docs/lora.md, "In the fleet").

One round (`_round`) reads the base service (in spec.serviceNamespace, or the adapter's own namespace;
another namespace only where the adapter's tenant may use it: desired.sharing_problem) and its ready pods
from the indexes, asks each pod's engine
what it serves (GET /v1/models), loads what is missing (or reloads what came from another folder), and
writes the status desired/lora_adapter.py computes from the answers. A round runs when the object is
created, changed or found at start-up, and on a timer: that is how a replica that became ready, or an
engine that restarted and forgot its adapters, gets the adapter again, and how the operator converges
after its own restart. Deleting the object unloads it from every ready replica first (kopf's finalizer);
an engine that answers 409 (requests still use the adapter) is asked again later. Then the adapter's
reservation against its Tenant's maxLoRAAdapters, if the webhook's ledger still holds one, is released
before the object goes (and again when it is seen gone, for an adapter deleted before its finalizer was
on): the next create need not wait for the reservation to expire.
"""

from __future__ import annotations

import logging
import threading
from typing import cast

import kopf

from flotilla import timestamps
from flotilla.contract import engine_token
from flotilla.operator.api.v1alpha1 import GROUP, LORA_ADAPTER, VERSION, LoRAAdapterSpec
from flotilla.operator.clients import engine_lora
from flotilla.operator.controllers import indexes
from flotilla.operator.controllers.indexes import index_one, labels_by_namespace, plain, tenant_specs
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.desired import lora_adapter as desired
from flotilla.operator.desired.lora_adapter import Outcome, Replica, Step, Unload
from flotilla.operator.desired.validation import describe
from flotilla.operator.tenancy.rules import owner_of

log = logging.getLogger("flotilla.operator.lora")

LORA = (GROUP, VERSION, LORA_ADAPTER.plural)
# How often each adapter's replicas are checked (GET /v1/models per ready pod): the longest a new replica or
# a restarted engine goes without the adapter.
RESYNC_SECONDS = 10.0
# Unload attempts on delete before the finalizer lets go (an engine that keeps refusing or never answers).
MAX_UNLOAD_RETRIES = 30


def _lock(rt: Runtime, key: tuple[str, str]) -> threading.Lock:
    """One round at a time per adapter: the timer and the change handlers run on different threads."""
    with rt.lock:
        return rt.lora_locks.setdefault(key, threading.Lock())


def _replicas(kwargs: dict, namespace: str, service: str) -> list[Replica]:
    store = indexes.of(kwargs)["pods"].get((namespace, service))
    return desired.ready_replicas(list(store) if store is not None else [])


def _sharing(kwargs: dict, namespace: str, base_ns: str) -> tuple[str, str] | None:
    """Why the adapter's tenant may not use a base in `base_ns` (None: it may), from the operator's indexes
    of Tenants and namespaces (flotilla.ownership's rule)."""
    if base_ns == namespace:
        return None
    found = indexes.of(kwargs)
    specs, labels = tenant_specs(found["tenants"]), labels_by_namespace(found["namespace_labels"])
    return desired.sharing_problem(owner_of(namespace, specs, labels), owner_of(base_ns, specs, labels))


def _token(rt: Runtime, namespace: str) -> str | None:
    """The namespace's internal engine token, which its engines ask of a load or an unload."""
    master = rt.config.engine_token_master
    return engine_token(master, namespace) if master is not None else None


def _converge(name: str, path: str, replica: Replica, token: str | None) -> Outcome:
    """One replica's round: what its engine serves, then the one call that makes it serve `path`."""
    code, listing = engine_lora.list_models(replica.url)
    if listing is None:
        return Outcome(desired.LOADING, "EngineUnreachable", f"GET /v1/models answered {code or 'nothing'}")
    served = desired.served_adapters(listing)
    step = desired.step(name, path, served)
    if step is Step.NOTHING:
        return Outcome(desired.LOADED, "Loaded", f"loaded from {desired.shown_path(path)}")
    if step is Step.RELOAD:
        code, text = engine_lora.unload(replica.url, name, token=token)
        if desired.unload_outcome(code) is not Unload.DONE:
            return Outcome(
                desired.LOADING,
                "Reloading",
                f"loaded from {served[name]}; its unload answered {code}: {text}",
            )
    code, text = engine_lora.load(replica.url, name, path, token=token)
    after = None
    if code != 200:
        _, listing = engine_lora.list_models(replica.url)
        after = desired.served_adapters(listing) if listing is not None else None
    outcome = desired.load_outcome(code, text, after, name, path)
    if outcome.phase == desired.LOADED:
        log.info("LoRA adapter %s loaded into %s from %s", name, replica.pod, desired.shown_path(path))
    return outcome


def _evict(name: str, replica: Replica, token: str | None) -> None:
    """Unloads `name` from the replica if its engine serves it (best effort: an engine that refuses, 409
    while requests use it, is asked again next round)."""
    _code, listing = engine_lora.list_models(replica.url)
    if listing is not None and name in desired.served_adapters(listing):
        code, text = engine_lora.unload(replica.url, name, token=token)
        log.info(
            "LoRA adapter %s: its base may no longer be used; unload from %s: %d %s",
            name,
            replica.pod,
            code,
            text,
        )


def _round(rt: Runtime, body: dict, patch: kopf.Patch, kwargs: dict) -> None:
    meta = body.get("metadata") or {}
    namespace, name = meta["namespace"], meta["name"]
    if meta.get("deletionTimestamp"):
        return
    with _lock(rt, (namespace, name)):
        spec, problems = desired.check(body.get("spec") or {})
        invalid = describe(problems) if problems else None
        blocked, outcomes, ready, served = None, {}, 0, name
        if spec is not None and invalid is None:
            path = desired.adapter_path(spec.source)
            base_ns = desired.base_namespace(namespace, spec)
            served = desired.served_name(name, namespace, base_ns)
            base = index_one(indexes.of(kwargs)["services"], (base_ns, spec.inference_service))
            blocked = _sharing(kwargs, namespace, base_ns)
            if blocked is not None:
                # A base the tenant may no longer use (its namespace changed owner): its engines let go.
                for replica in _replicas(kwargs, base_ns, spec.inference_service):
                    _evict(served, replica, _token(rt, base_ns))
            claim = desired.source_claim(spec.source)
            blocked = blocked or desired.base_problem(
                served, base_ns, spec.inference_service, base, path, claim
            )
            if blocked is None:
                replicas = _replicas(kwargs, base_ns, spec.inference_service)
                ready = len(replicas)
                outcomes = {r.pod: _converge(served, path, r, _token(rt, base_ns)) for r in replicas}
        previous = cast(dict, plain(body.get("status") or {}))
        new = desired.status(
            name=served,
            generation=meta.get("generation"),
            invalid=invalid,
            blocked=blocked,
            outcomes=outcomes,
            ready_count=ready,
            previous=previous,
            now=timestamps.now(),
        )
        new = {k: v for k, v in new.items() if v is not None}
        if any(previous.get(k) != v for k, v in new.items()):
            patch["status"] = new


@kopf.on.resume(*LORA)
@kopf.on.create(*LORA)
@kopf.on.update(*LORA)
def reconcile(body: kopf.Body, old, patch: kopf.Patch, memo: kopf.Memo, **kwargs) -> None:
    rt: Runtime = memo.runtime
    new_body = cast(dict, plain(body))
    namespace, name = new_body["metadata"]["namespace"], new_body["metadata"]["name"]
    before, after = _base(namespace, (old or {}).get("spec")), _base(namespace, new_body.get("spec"))
    if before is not None and before != after:
        # The adapter moved to another base service: the old one's replicas let it go (best effort; an
        # engine that still holds it serves it under a name no object owns until it restarts).
        base_ns, service = before
        served = desired.served_name(name, namespace, base_ns)
        for replica in _replicas(kwargs, base_ns, service):
            engine_lora.unload(replica.url, served, token=_token(rt, base_ns))
    _round(rt, new_body, patch, kwargs)


def _base(namespace: str, spec: dict | None) -> tuple[str, str] | None:
    """(the base's namespace, its name) as a spec names them; None without one."""
    service = (spec or {}).get("inferenceService")
    return ((spec or {}).get("serviceNamespace") or namespace, service) if service else None


@kopf.timer(*LORA, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def resync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kwargs) -> None:
    _round(memo.runtime, plain(body), patch, kwargs)


@kopf.on.delete(*LORA)
def unload(body: kopf.Body, retry: int, memo: kopf.Memo, **kwargs) -> None:
    """Unload from every ready replica before the object goes; 409 (in use) and no answer are retried.
    Then release the adapter's admission reservation (tenancy/reservations.py)."""
    meta = body.get("metadata") or {}
    namespace, name = meta["namespace"], meta["name"]
    spec, problems = desired.check(plain(body.get("spec") or {}))
    if spec is not None and not problems:  # else never loaded anywhere
        _unload_everywhere(memo.runtime, namespace, name, spec, retry, kwargs)
    with memo.runtime.lock:
        memo.runtime.lora_locks.pop((namespace, name), None)
    _release(memo, namespace, name, meta.get("uid") or "")


@kopf.on.event(*LORA)
def deleted(event: dict, namespace: str, name: str, memo: kopf.Memo, **_) -> None:
    """An adapter deleted before the operator put its finalizer on (or while none ran): its reservation
    is released all the same, when the operator sees it gone (a second release finds nothing to drop)."""
    if event.get("type") == "DELETED":
        _release(memo, namespace, name, ((event.get("object") or {}).get("metadata") or {}).get("uid") or "")


def _release(memo: kopf.Memo, namespace: str, name: str, uid: str) -> None:
    try:
        memo.admission.release((namespace, name), uid, adapter=True)
    except Exception as exc:  # the reservation expires by itself; say why it lingers
        log.warning(
            "could not release the admission reservation of LoRA adapter %s/%s: %s", namespace, name, exc
        )


def _unload_everywhere(
    rt: Runtime, namespace: str, name: str, spec: LoRAAdapterSpec, retry: int, kwargs: dict
) -> None:
    pending = []
    base_ns = desired.base_namespace(namespace, spec)
    served = desired.served_name(name, namespace, base_ns)
    with _lock(rt, (namespace, name)):
        for replica in _replicas(kwargs, base_ns, spec.inference_service):
            code, text = engine_lora.unload(replica.url, served, token=_token(rt, base_ns))
            outcome = desired.unload_outcome(code)
            if outcome is Unload.RETRY:
                pending.append(f"{replica.pod} ({code or 'no answer'}: {text.strip()[:200]})")
            elif outcome is Unload.FAILED:
                log.warning(
                    "LoRA adapter %s/%s: %s refused its unload (%d): %s",
                    namespace,
                    name,
                    replica.pod,
                    code,
                    text,
                )
            else:
                log.info("LoRA adapter %s/%s unloaded from %s", namespace, name, replica.pod)
    if pending and retry < MAX_UNLOAD_RETRIES:
        raise kopf.TemporaryError(
            f"not unloaded yet from {', '.join(pending)}", delay=2 if retry < 10 else 10
        )
    if pending:
        log.warning("LoRA adapter %s/%s: giving up unloading from %s", namespace, name, ", ".join(pending))
