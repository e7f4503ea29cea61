"""Where the InferencePools' endpointPickerRef resolves: in each namespace with InferenceServices, a
selector-less Service `flotilla-gateway` with the picker's port, and an EndpointSlice listing the gateway's
pods (which run in the operator's namespace) on that port. Pure.

GIE's endpointPickerRef has no namespace: it names a Service in the pool's own namespace, while the chart
runs one gateway in its own. A Service cannot select pods of another namespace, so the operator keeps its
endpoints itself: the Service has no selector, and the EndpointSlice (labelled with the Service's name and
`endpointslice.kubernetes.io/managed-by`, so Kubernetes' own EndpointSlice controller leaves it alone) lists
each gateway pod's IPv4 address on PICKER_PORT, ready as the pod's Ready condition says. A GIE gateway
(Istio, kgateway) reaches `flotilla-gateway.<pool's namespace>:9002` and lands on Flotilla's picker.

Ownership. Both objects are shared by every InferenceService of the namespace, and an owner reference cannot
cross namespaces: each carries one (non-controller) owner reference per InferenceService of its namespace,
so the garbage collector removes them when the last of those services is gone, and drops a deleted
service's reference while others remain. The operator never deletes them itself.

Never adopted: a `flotilla-gateway` Service the operator did not make (it lacks the operator's labels, or
has a selector) is left as it is, with no EndpointSlice beside it; the pools' ResolvedRefs then reports on
that Service as on any other (desired/inference_pool.py). The gateway's own namespace is skipped: the
chart's gateway Service is there.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flotilla.contract import GATEWAY_SERVICE, PICKER_PORT
from flotilla.operator.api.conditions import is_ready
from flotilla.operator.api.v1alpha1 import API_VERSION, INFERENCE_SERVICE
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.drift import contains
from flotilla.operator.naming import MANAGED_BY, MANAGED_BY_LABEL

# The gateway's pods, in config.gateway_namespace (the chart's flotilla.gatewaySelectorLabels, less the
# release's instance label, which the operator does not know).
GATEWAY_POD_LABELS = {"app.kubernetes.io/name": GATEWAY_SERVICE}

PORT_NAME = "grpc-ext-proc"  # GIE's reference picker's port name; `grpc-` also tells Istio the protocol
APP_PROTOCOL = "kubernetes.io/h2c"  # gRPC in cleartext HTTP/2, as GIE's gateways dial the picker
SLICE_API_VERSION = "discovery.k8s.io/v1"
SLICE_NAME = f"{GATEWAY_SERVICE}-picker"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # which Service a slice serves
SLICE_MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
# Not the EndpointSlice controller's (endpointslice-controller.k8s.io), so it leaves the slice alone. A label
# value: no slash.
SLICE_MANAGER = "operator.flotilla.dev"
COMPONENT_LABEL = "app.kubernetes.io/component"
COMPONENT = "endpoint-picker"

LABELS = {MANAGED_BY_LABEL: MANAGED_BY, COMPONENT_LABEL: COMPONENT}


@dataclass(frozen=True)
class ServiceRef:
    """An InferenceService that owns the namespace's picker objects (with the others of its namespace)."""

    name: str
    uid: str

    def reference(self) -> dict:
        # Not the controller: several services share the objects; no blockOwnerDeletion either, so a
        # service's foreground deletion never waits on them.
        return {"apiVersion": API_VERSION, "kind": INFERENCE_SERVICE.kind, "name": self.name, "uid": self.uid}


def owners_by_namespace(services: Iterable[dict], config: OperatorConfig) -> dict[str, list[ServiceRef]]:
    """The namespaces whose InferencePools need the picker's Service, each with the InferenceServices that
    own it (by name): every namespace with a live InferenceService, when the operator makes pools, but the
    gateway's own."""
    if not config.inference_pools:
        return {}
    owners: dict[str, list[ServiceRef]] = {}
    for obj in services:
        meta = obj.get("metadata") or {}
        namespace = meta.get("namespace")
        if not namespace or namespace == config.gateway_namespace or meta.get("deletionTimestamp"):
            continue
        owners.setdefault(namespace, []).append(ServiceRef(meta["name"], meta.get("uid", "")))
    return {ns: sorted(refs, key=lambda r: r.name) for ns, refs in sorted(owners.items())}


def _metadata(name: str, namespace: str, owners: list[ServiceRef], labels: Mapping[str, str]) -> dict:
    return {
        "name": name,
        "namespace": namespace,
        "labels": dict(labels),
        "ownerReferences": [o.reference() for o in owners],
    }


def picker_service(namespace: str, owners: list[ServiceRef]) -> dict:
    """The Service endpointPickerRef names, in `namespace`: no selector (its EndpointSlice is the
    operator's), the picker's port."""
    port = {"name": PORT_NAME, "port": PICKER_PORT, "targetPort": PICKER_PORT, "protocol": "TCP",
            "appProtocol": APP_PROTOCOL}  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(GATEWAY_SERVICE, namespace, owners, LABELS),
        "spec": {"type": "ClusterIP", "ports": [port]},
    }


def _ipv4(pod: dict) -> str | None:
    """The pod's IPv4 address, if it has one an EndpointSlice may hold: the API refuses loopback,
    link-local, multicast and unspecified addresses (the local cluster's pods are on 127.x: none is listed
    there)."""
    status = pod.get("status") or {}
    candidates = [status.get("podIP"), *(p.get("ip") for p in status.get("podIPs") or [])]
    for ip in candidates:
        try:
            address = ipaddress.ip_address(ip or "")
        except ValueError:
            continue
        if address.version == 4 and not (
            address.is_loopback or address.is_link_local or address.is_multicast or address.is_unspecified
        ):
            return ip
    return None


def gateway_endpoints(pods: Iterable[dict], gateway_namespace: str) -> list[dict]:
    """The gateway's pods as EndpointSlice endpoints, by pod name: those with an IPv4 address a slice may
    hold that have not finished. ready and serving mirror the pod's Ready condition (a terminating pod is not ready, and says
    so), as Kubernetes' EndpointSlice controller does."""
    endpoints = []
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", "")):
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ip = _ipv4(pod)
        if ip is None or status.get("phase") in ("Succeeded", "Failed"):
            continue
        ready, terminating = is_ready(pod), bool(meta.get("deletionTimestamp"))
        endpoint = {
            "addresses": [ip],
            "conditions": {"ready": ready and not terminating, "serving": ready, "terminating": terminating},
            "targetRef": {"kind": "Pod", "namespace": gateway_namespace, "name": meta.get("name", "")},
        }
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            endpoint["nodeName"] = node
        endpoints.append(endpoint)
    return endpoints


def picker_slice(
    namespace: str, owners: list[ServiceRef], pods: Iterable[dict], gateway_namespace: str
) -> dict:
    """The EndpointSlice of the picker's Service in `namespace`: the gateway's pods on the picker's port."""
    labels = {**LABELS, SERVICE_NAME_LABEL: GATEWAY_SERVICE, SLICE_MANAGED_BY_LABEL: SLICE_MANAGER}
    return {
        "apiVersion": SLICE_API_VERSION,
        "kind": "EndpointSlice",
        "metadata": _metadata(SLICE_NAME, namespace, owners, labels),
        "addressType": "IPv4",
        "ports": [{"name": PORT_NAME, "port": PICKER_PORT, "protocol": "TCP", "appProtocol": APP_PROTOCOL}],
        "endpoints": gateway_endpoints(pods, gateway_namespace),
    }


def is_ours(service: dict | None) -> bool:
    """Whether an observed `flotilla-gateway` Service is one the operator made: its labels, no selector.
    Anything else (the chart's, a user's, an InferenceService named flotilla-gateway) is not adopted."""
    if service is None:
        return False
    labels = (service.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in LABELS.items()) and not (service.get("spec") or {}).get(
        "selector"
    )


def _owner_uids(obj: dict) -> set[str]:
    return {r.get("uid", "") for r in (obj.get("metadata") or {}).get("ownerReferences") or []}


def _matches(observed: dict | None, desired: dict, fields: tuple[str, ...]) -> bool:
    """Whether the observed object holds what the desired one says: its labels, exactly its owners, and
    each of `fields` (containment: the API server adds defaults; an empty list may come back as null)."""
    if observed is None:
        return False
    want_meta, have_meta = desired["metadata"], observed.get("metadata") or {}
    if not contains(have_meta.get("labels") or {}, want_meta["labels"]):
        return False
    if _owner_uids(observed) != _owner_uids(desired):
        return False
    for name in fields:
        have = observed
        want = desired
        for part in name.split("."):
            have, want = (have or {}).get(part), want[part]
        if not contains(have if have is not None else type(want)(), want):
            return False
    return True


@dataclass(frozen=True)
class NamespacePicker:
    """What one namespace needs: `apply`, the objects to server-side apply (in order: the Service, then its
    slice), empty when the observed ones already match or when `foreign`; `foreign`: a `flotilla-gateway`
    Service the operator did not make is there, and is left alone."""

    namespace: str
    apply: list[dict]
    foreign: bool = False


def plan_namespace(
    namespace: str,
    owners: list[ServiceRef],
    pods: Iterable[dict],
    config: OperatorConfig,
    observed_service: dict | None,
    observed_slice: dict | None,
) -> NamespacePicker:
    """The writes that bring one namespace's picker Service and EndpointSlice in line (nothing when it has no
    owners left: the garbage collector removes them)."""
    if not owners:
        return NamespacePicker(namespace, [])
    if observed_service is not None and not is_ours(observed_service):
        return NamespacePicker(namespace, [], foreign=True)
    service = picker_service(namespace, owners)
    slice_ = picker_slice(namespace, owners, pods, config.gateway_namespace)
    apply = []
    if not _matches(observed_service, service, ("spec.type", "spec.ports")):
        apply.append(service)
    if not _matches(observed_slice, slice_, ("addressType", "ports", "endpoints")):
        apply.append(slice_)
    return NamespacePicker(namespace, apply)


def plan_all(
    services: Iterable[dict],
    pods: Iterable[dict],
    config: OperatorConfig,
    observed_services: Mapping[str, dict],
    observed_slices: Mapping[str, dict],
    namespaces: Iterable[str] | None = None,
) -> list[NamespacePicker]:
    """Every namespace's (or those of `namespaces`) picker objects, from the InferenceServices, the
    gateway's pods and what is observed of both objects per namespace."""
    owners = owners_by_namespace(services, config)
    pods = list(pods)
    wanted = sorted(owners) if namespaces is None else sorted(set(namespaces))
    return [
        plan_namespace(
            ns, owners.get(ns, []), pods, config, observed_services.get(ns), observed_slices.get(ns)
        )
        for ns in wanted
    ]
