"""The InferencePool each InferenceService gets (the Gateway API Inference Extension's,
`inference.networking.k8s.io/v1`), and the entry the operator keeps in its status. Pure.

The pool is named like the service, in its namespace, owned by it (the garbage collector deletes it with
the service) and applied with the other children. Its spec says what a GIE gateway needs to route to the
service: the engine pods (the selector the Deployment uses), the engine port, HTTP/1.1, and Flotilla's
endpoint picker (`endpointPickerRef`: the gateway's Service on the picker's port, FailClose).

Status. The standard's status is per parent: `status.parents`, an atomic list of at most 32 entries,
each a `parentRef` (typically a Gateway), the `controllerName` of whoever wrote it and the conditions
`Accepted` and `ResolvedRefs`. Each controller keeps the entries of the parents it manages and no other.
The operator manages one parent: Flotilla's own gateway, which serves every InferenceService. Its entry
names the gateway's Service (`parentRef` group "", kind Service) and CONTROLLER_NAME, and says:

- Accepted True, reason Accepted: Flotilla's gateway serves the service whose pods the pool selects;
- ResolvedRefs True, reason ResolvedRefs, when `endpointPickerRef` resolves: a Service of that name in
  the pool's namespace (the reference has no namespace of its own) with the picker's port; else False,
  reason InvalidExtensionRef, saying which part is missing.

Entries other controllers wrote (an Istio or kgateway Gateway whose HTTPRoute references the pool) are
kept as they are. docs/inference-extension.md explains the choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.contract import ENGINE_PORT, GATEWAY_SERVICE, PICKER_PORT
from flotilla.operator.api import inference_extension as gie
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.workload import Decision, Owner, child_metadata
from flotilla.operator.naming import selector_labels

# Who wrote the operator's entry in status.parents (the standard's DOMAIN/PATH form).
CONTROLLER_NAME = "flotilla.dev/operator"


def picker_ref() -> dict:
    """spec.endpointPickerRef: Flotilla's endpoint picker, the gateway's Service on the picker's port.
    FailClose (the standard's default, written out): the picker applies keys, tenancy and quota, so a
    gateway that cannot reach it must refuse the request rather than pick an engine itself."""
    return {
        "group": "",
        "kind": "Service",
        "name": GATEWAY_SERVICE,
        "port": {"number": PICKER_PORT},
        "failureMode": gie.FAIL_CLOSE,
    }


def inference_pool(owner: Owner, decision: Decision) -> dict:
    """The InferencePool of one InferenceService: its engine pods, on the engine port."""
    return {
        "apiVersion": gie.API_VERSION,
        "kind": gie.KIND,
        "metadata": child_metadata(owner, decision),
        "spec": {
            # The Deployment's selector: every engine pod of the service and nothing else, whatever its
            # tenant label says.
            "selector": {"matchLabels": selector_labels(owner.name)},
            "targetPorts": [{"number": ENGINE_PORT}],
            "appProtocol": gie.APP_PROTOCOL_HTTP,
            "endpointPickerRef": picker_ref(),
        },
    }


def parent_ref(config: OperatorConfig) -> dict:
    """The parent the operator reports for: Flotilla's gateway, by its Service."""
    return {"group": "", "kind": "Service", "name": GATEWAY_SERVICE, "namespace": config.gateway_namespace}


@dataclass(frozen=True)
class PoolStatus:
    """A status write for an InferencePool: the whole status, conditional on the resourceVersion it was
    computed from (status.parents is an atomic list other controllers write too)."""

    name: str
    namespace: str
    resource_version: str
    status: dict


def picker_ports(service: dict | None) -> tuple[int, ...] | None:
    """The ports of the Service endpointPickerRef names, as observed in the pool's namespace; None when
    there is no such Service."""
    if service is None:
        return None
    return tuple(p.get("port") for p in (service.get("spec") or {}).get("ports") or [] if p.get("port"))


def resolved_refs(namespace: str, ports: tuple[int, ...] | None) -> tuple[bool, str, str]:
    """Whether endpointPickerRef resolves in `namespace`: (ok, reason, message)."""
    ref = f"endpointPickerRef: Service {GATEWAY_SERVICE}"
    if ports is None:
        return (
            False,
            gie.REASON_INVALID_EXTENSION_REF,
            f"{ref} does not exist in namespace {namespace}: Flotilla's endpoint picker does not serve "
            "this namespace yet",
        )
    if PICKER_PORT not in ports:
        shown = ", ".join(str(p) for p in ports) or "none"
        return (
            False,
            gie.REASON_INVALID_EXTENSION_REF,
            f"{ref} has no port {PICKER_PORT} (the picker's; it has {shown})",
        )
    return True, gie.REASON_RESOLVED_REFS, f"{ref} port {PICKER_PORT}"


def parent_status(
    owner: Owner, generation: int, ports: tuple[int, ...] | None, config: OperatorConfig,
    previous: dict | None, now: str,
) -> dict:  # fmt: skip
    """The operator's entry in status.parents; a condition keeps its lastTransitionTime while its status
    stays the same (metav1.Condition's rule)."""
    before = {c.get("type"): c for c in (previous or {}).get("conditions") or []}
    ok, reason, message = resolved_refs(owner.namespace, ports)
    conditions = []
    for type_, status, why, text in (
        (gie.ACCEPTED, True, gie.REASON_ACCEPTED,
         f"Flotilla's gateway serves InferenceService {owner.name}, whose engine pods this pool selects"),
        (gie.RESOLVED_REFS, ok, reason, message),
    ):  # fmt: skip
        value = "True" if status else "False"
        old = before.get(type_) or {}
        since = (
            old["lastTransitionTime"] if old.get("status") == value and old.get("lastTransitionTime") else now
        )
        conditions.append(
            {
                "type": type_,
                "status": value,
                "reason": why,
                "message": text,
                "observedGeneration": generation,
                "lastTransitionTime": since,
            }
        )
    return {"parentRef": parent_ref(config), "controllerName": CONTROLLER_NAME, "conditions": conditions}


def pool_status(
    owner: Owner, pool: dict, picker_service: dict | None, config: OperatorConfig, now: str
) -> PoolStatus | None:
    """The status write that puts the operator's entry into the observed pool's status.parents, the
    other controllers' entries kept in place; None when the pool already says it (or, rarely, when other
    parents fill all 32 places)."""
    meta = pool.get("metadata") or {}
    parents = list((pool.get("status") or {}).get("parents") or [])
    mine = [i for i, p in enumerate(parents) if p.get("controllerName") == CONTROLLER_NAME]
    previous = parents[mine[0]] if mine else None
    entry = parent_status(
        owner, meta.get("generation", 0), picker_ports(picker_service), config, previous, now
    )
    others = [p for p in parents if p.get("controllerName") != CONTROLLER_NAME]
    if mine:
        # In the first one's place; any duplicates of ours go.
        wanted = [*others[: mine[0]], entry, *others[mine[0] :]]
    elif len(others) < gie.MAX_PARENTS:
        wanted = [*others, entry]
    else:
        return None
    if wanted == parents:
        return None
    return PoolStatus(
        name=owner.name,
        namespace=owner.namespace,
        resource_version=meta.get("resourceVersion", ""),
        status={"parents": wanted},
    )
