"""One service brought in line with its plan: gather a World from the indexes, call the pure `plan`,
server-side apply the children, write status when it changed, post the plan's events. Every handler
that reconciles goes through one of these, each saying which children the event may have changed:

- `reconcile`: the service itself was created, changed or found at start-up: apply every child;
- `correct_drift`: one child changed or vanished: re-apply it if it no longer matches the plan;
- `refresh_status`: something status reads changed (a pod): apply nothing, write status;
- `retry_services`: the world changed (nodes, namespaces, Tenants, freed quota): for each service it may
  unblock, re-apply the Deployment if it no longer matches (it carries what such a change can alter);
- `refresh_services`: something the status of several services reads changed (the Service their
  InferencePools' endpointPickerRef names): write their status, apply nothing.

Each also writes the service's InferencePool status when the plan has one to write.

Applying is idempotent; choosing the children only saves calls."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable

import kopf
from kubernetes.client.exceptions import ApiException

from flotilla import timestamps
from flotilla.operator.api import inference_extension as gie
from flotilla.operator.clients.kube import api_error_message
from flotilla.operator.controllers import backstop, failpoints
from flotilla.operator.controllers.indexes import index_one, labels_by_namespace, tenant_specs
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.desired.drift import drifted
from flotilla.operator.desired.reconcile import Event, Plan, World, plan, status_changed
from flotilla.operator.desired.status import service_figures, with_apply_failures
from flotilla.operator.metrics import RECONCILE_DURATION, RECONCILE_ERRORS, RECONCILES, SERVICES
from flotilla.operator.tenancy.quota import Held, Key
from flotilla.operator.tenancy.rules import namespaces_owned, tenant_of

log = logging.getLogger("flotilla.operator")

# Given the plan and the service's key, the desired children to send.
Choose = Callable[[Plan, Key], list[dict]]


class ApplyFailed(Exception):
    pass


def reconcile(rt: Runtime, obj: dict, idx: dict, trigger: str) -> Plan:
    """Plan the service and apply every child: its spec (or the operator) changed."""
    return _bring_in_line(rt, obj, idx, trigger, lambda result, key: result.children)


def correct_drift(rt: Runtime, obj: dict, idx: dict, trigger: str, observed: dict) -> Plan:
    """One child changed or vanished (`observed`: the child as the watch saw it, or only its kind when it
    was deleted): re-apply it if it no longer matches the plan, and write status."""

    def drifted_child(result: Plan, key: Key) -> list[dict]:
        to_apply = [c for c in result.children if c["kind"] == observed.get("kind") and drifted(observed, c)]
        if to_apply:
            log.info(
                "correcting drift of %s %s/%s: %s",
                observed.get("kind"),
                *key,
                drifted(observed, to_apply[0]),
            )
        return to_apply

    return _bring_in_line(rt, obj, idx, trigger, drifted_child)


def refresh_status(rt: Runtime, obj: dict, idx: dict, trigger: str) -> Plan:
    """Plan the service and write its status; apply nothing (a pod changed: status reads pods)."""
    return _bring_in_line(rt, obj, idx, trigger, lambda result, key: [])


def _retry(rt: Runtime, obj: dict, idx: dict, trigger: str) -> Plan:
    """The world changed in a way that may unblock the service: re-apply its Deployment, which carries what
    such a change can alter (replicas, the tenant label), if it no longer matches; every child when no
    Deployment is indexed."""

    def changed_deployment(result: Plan, key: Key) -> list[dict]:
        deployment = index_one(idx["deployments"], key)
        if deployment is None:
            return result.children
        return [c for c in result.children if c["kind"] == "Deployment" and drifted(deployment, c)]

    return _bring_in_line(rt, obj, idx, trigger, changed_deployment)


def _bring_in_line(rt: Runtime, obj: dict, idx: dict, trigger: str, choose: Choose) -> Plan:
    """Plan one service and carry the plan out, applying the children `choose` picks."""
    meta = obj["metadata"]
    key = (meta["namespace"], meta["name"])
    RECONCILES.labels(trigger).inc()
    with _key_lock(rt, key), RECONCILE_DURATION.labels(trigger).time():
        try:
            before = rt.held.get(key)
            result = _plan(rt, obj, key, idx)
            if (
                result.held is not None
                and result.held.tenant
                and result.held.gpus > (before.gpus if before else 0)
            ):
                # The namespace's GPU limit first, or the new pods meet the old one.
                _raise_backstop(rt, result.held.tenant, idx)
            _write(rt, obj, result, key, apply=choose(result, key))
            return result
        except Exception:
            RECONCILE_ERRORS.labels(trigger).inc()
            raise


def _raise_backstop(rt: Runtime, tenant: str, idx: dict) -> None:
    specs = tenant_specs(idx["tenants"])
    labels = labels_by_namespace(idx["namespace_labels"])
    if tenant not in specs:
        return
    owned = [ns for ns in namespaces_owned(tenant, specs, labels) if ns in labels]
    backstop.raise_limits(rt, tenant, backstop.limits(rt, tenant, specs[tenant], owned, idx["gpu_pods"]))


def retry_services(rt: Runtime, idx: dict, wanted: Callable[[dict, dict], bool], trigger: str) -> None:
    """Retry every service for which wanted(obj, {condition type: status}) holds: the world changed in a
    way that may unblock it."""
    for store in list(idx["services"].values()):
        for obj in store:
            if wanted(obj, conditions(obj)):
                try:
                    _retry(rt, obj, idx, trigger)
                except Exception:
                    log.exception(
                        "retrying %s/%s failed", obj["metadata"]["namespace"], obj["metadata"]["name"]
                    )


def refresh_services(rt: Runtime, idx: dict, wanted: Callable[[dict], bool], trigger: str) -> None:
    """Refresh the status of every service for which wanted(obj) holds; apply nothing."""
    for store in list(idx["services"].values()):
        for obj in store:
            if wanted(obj):
                try:
                    refresh_status(rt, obj, idx, trigger)
                except Exception:
                    log.exception(
                        "refreshing %s/%s failed", obj["metadata"]["namespace"], obj["metadata"]["name"]
                    )


def conditions(obj: dict) -> dict[str, str]:
    return {c.get("type"): c.get("status") for c in (obj.get("status") or {}).get("conditions") or []}


def not_served(exc: ApiException) -> bool:
    """A 404 because the API has no such resource (its CRD is not installed), not because the object's
    namespace is missing: the latter's Status names the namespace in its details."""
    if exc.status != 404:
        return False
    try:
        details = json.loads(exc.body or "{}").get("details") or {}
    except (TypeError, ValueError):
        return True  # a plain "404 page not found": no handler for the path at all
    return details.get("kind") != "namespaces"


def _write_pool_status(rt: Runtime, result: Plan) -> None:
    """The operator's parent entry in the InferencePool's status. A conflict (another writer came first)
    or a pool that went is left to the pool's own watch event, which plans again from what it sees."""
    write = result.pool_status
    assert write is not None
    try:
        rt.kube.patch_pool_status(write.namespace, write.name, write.resource_version, write.status)
    except ApiException as exc:
        if exc.status in (404, 409):
            log.debug("InferencePool %s/%s status not written: %s", write.namespace, write.name, exc.status)
        else:
            log.warning(
                "InferencePool %s/%s status not written: %s",
                write.namespace,
                write.name,
                api_error_message(exc),
            )


def going_away(exc: Exception) -> bool:
    """The API refused because the object's namespace is being deleted."""
    return getattr(exc, "status", None) == 403 and "being terminated" in str(getattr(exc, "body", ""))


# ---------------------------------------------------------------------------------------------------


def _key_lock(rt: Runtime, key: Key) -> threading.Lock:
    with rt.lock:
        return rt.key_locks.setdefault(key, threading.Lock())


def _seed_held(rt: Runtime, idx: dict) -> None:
    """After a restart, the ledger starts from what services' status says they were granted."""
    specs, labels = tenant_specs(idx["tenants"]), labels_by_namespace(idx["namespace_labels"])
    seeds = []
    for key, store in idx["services"].items():
        for obj in store:
            spec, status = obj.get("spec") or {}, obj.get("status") or {}
            resources = spec.get("resources") or {}
            tenant = tenant_of(key[0], specs, labels) or ""
            gpus = status.get("desiredReplicas", 0) * resources.get("gpus", 1)
            seeds.append(Held(key, tenant, resources.get("gpuType"), gpus))
    rt.held.seed(seeds)
    rt.held_seeded = True


def _plan(rt: Runtime, obj: dict, key: Key, idx: dict) -> Plan:
    written = rt.written_status.get(key)
    if written is not None:
        # Our own last write may be newer than the watch has delivered; transition times come from it.
        obj = {**obj, "status": written}
    with rt.lock:  # two services of one tenant must not both plan against the same free quota
        if not rt.held_seeded:
            _seed_held(rt, idx)
        world = World(
            config=rt.config,
            now=timestamps.now(),
            gpu_types=set(idx["gpu_nodes"].keys()),
            tenants=tenant_specs(idx["tenants"]),
            namespace_labels=labels_by_namespace(idx["namespace_labels"]),
            held_by_others=rt.held.others(key),
            deployment=index_one(idx["deployments"], key),
            pods=list(idx["pods"].get(key, [])),
            path_exists=os.path.isdir if rt.config.check_local_model_paths else None,
            inference_pool=index_one(idx["inference_pools"], key),
            picker_service=index_one(idx["picker_services"], key[0]),
        )
        result = plan(obj, world)
        if result.held is not None:
            rt.held.hold(result.held)
    return result


def _write(rt: Runtime, obj: dict, result: Plan, key: Key, *, apply: Iterable[dict]) -> None:
    # Remembered until that kind is applied successfully, so status does not flip back and forth
    # between refreshes that re-apply nothing.
    refused = rt.refused.setdefault(key, {})
    for child in apply:
        try:
            rt.kube.apply(child)
            refused.pop(child["kind"], None)
        except ApiException as exc:
            if child["kind"] == gie.KIND and not_served(exc):
                refused[child["kind"]] = (
                    f"{gie.KIND} {key[1]}: the API serves no {gie.CRD_NAME}: install the Gateway API "
                    "Inference Extension's CRD (crds/, the chart) or run the operator with --no-inference-pools"
                )
                continue
            if exc.status == 404 or going_away(exc):
                raise
            refused[child["kind"]] = f"{child['kind']} {key[1]}: {api_error_message(exc)}"
    if apply and obj["metadata"].get("generation") != (obj.get("status") or {}).get("observedGeneration"):
        failpoints.reached("reconcile.applied")  # a spec change carried out, not yet recorded
    failures = list(refused.values()) if result.children else []
    status, events = result.status, list(result.events)
    if failures:
        status = with_apply_failures(status, failures, timestamps.now())
        before = rt.written_status.get(key, obj.get("status")) or {}
        if before.get("message") != status["message"]:
            events.append(Event("Warning", "ApplyFailed", status["message"]))
    current = rt.written_status.get(key, obj.get("status"))
    if status_changed(current, status):
        rt.kube.patch_service_status(key[0], key[1], status)
        rt.written_status[key] = status
    if result.pool_status is not None:
        _write_pool_status(rt, result)
    SERVICES.update(key[0], key[1], service_figures(obj.get("spec") or {}, status))
    for event in events:
        kopf.event(obj, type=event.type, reason=event.reason, message=event.message[:1000])
    if failures and any(child["kind"] in refused for child in apply):
        raise ApplyFailed("; ".join(failures))
