"""The picker's Service and EndpointSlice in each namespace with InferenceServices: pure planning
(desired/picker_endpoints.py), and the kopf layer's round over a fake client (controllers/picker_endpoints.py).
No Kubernetes API."""

from __future__ import annotations

import json

from kubernetes.client.exceptions import ApiException

from flotilla.contract import GATEWAY_SERVICE, PICKER_PORT
from flotilla.operator.config import OperatorConfig
from flotilla.operator.controllers.picker_endpoints import sync_pickers
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.desired.inference_pool import picker_ports, resolved_refs
from flotilla.operator.desired.picker_endpoints import (
    APP_PROTOCOL,
    SLICE_NAME,
    ServiceRef,
    gateway_endpoints,
    is_ours,
    owners_by_namespace,
    picker_service,
    picker_slice,
    plan_all,
    plan_namespace,
)
from flotilla.operator.manifests.rbac import cluster_rules

CONFIG = OperatorConfig(gateway_namespace="flotilla-system")
GW = "flotilla-system"


def _isvc(namespace: str, name: str, uid: str | None = None, deleting: bool = False) -> dict:
    meta = {"namespace": namespace, "name": name, "uid": uid or f"uid-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {}}


def _pod(name: str, ip: str | None = "10.0.0.5", ready: bool = True, **extra) -> dict:
    status: dict = {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]}
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    meta = {"name": name, **extra.pop("meta", {})}
    return {"metadata": meta, "spec": {"nodeName": "node-1"}, "status": {**status, **extra}}


OWNERS = [ServiceRef("chat", "uid-chat"), ServiceRef("embed", "uid-embed")]


# ---------------------------------------------------------------------------------------------------
# Pure


def test_every_namespace_with_live_services_but_the_gateways_own_gets_one():
    services = [
        _isvc("team-b", "embed"),
        _isvc("team-a", "chat"),
        _isvc("team-a", "code"),
        _isvc("team-c", "old", deleting=True),
        _isvc(GW, "internal"),
    ]
    owners = owners_by_namespace(services, CONFIG)
    assert owners == {
        "team-a": [ServiceRef("chat", "uid-chat"), ServiceRef("code", "uid-code")],
        "team-b": [ServiceRef("embed", "uid-embed")],
    }
    # No pools, no picker Services.
    assert owners_by_namespace(services, OperatorConfig(inference_pools=False)) == {}


def test_the_service_has_no_selector_the_pickers_port_and_every_service_as_owner():
    svc = picker_service("team-a", OWNERS)
    assert svc["metadata"]["name"] == GATEWAY_SERVICE and svc["metadata"]["namespace"] == "team-a"
    assert "selector" not in svc["spec"]
    assert svc["spec"]["ports"] == [
        {"name": "grpc-ext-proc", "port": PICKER_PORT, "targetPort": PICKER_PORT, "protocol": "TCP",
         "appProtocol": "kubernetes.io/h2c"}
    ]  # fmt: skip
    refs = svc["metadata"]["ownerReferences"]
    assert [r["uid"] for r in refs] == ["uid-chat", "uid-embed"]
    assert all(r["kind"] == "InferenceService" and "controller" not in r for r in refs)
    assert is_ours(svc)
    # What the pools' ResolvedRefs make of it.
    assert resolved_refs("team-a", picker_ports(svc))[0] is True


def test_the_slice_lists_the_gateway_pods_with_their_readiness():
    pods = [
        _pod("gw-b", "10.0.0.7", ready=False),
        _pod("gw-a", "10.0.0.6"),
        _pod("gw-c", "10.0.0.8", meta={"deletionTimestamp": "2026-01-01T00:00:00Z"}),
        _pod("gw-pending", None),
        _pod("gw-done", "10.0.0.9", phase="Succeeded"),
        _pod("gw-v6", "fd00::1"),
        _pod("gw-local", "127.80.0.3"),  # the local cluster's: the API refuses loopback in a slice
        _pod("gw-link", "169.254.1.1"),
    ]
    slice_ = picker_slice("team-a", OWNERS, pods, GW)
    assert slice_["metadata"]["name"] == SLICE_NAME
    labels = slice_["metadata"]["labels"]
    assert labels["kubernetes.io/service-name"] == GATEWAY_SERVICE
    assert labels["endpointslice.kubernetes.io/managed-by"] == "operator.flotilla.dev"
    assert slice_["addressType"] == "IPv4"
    assert slice_["ports"] == [
        {"name": "grpc-ext-proc", "port": PICKER_PORT, "protocol": "TCP", "appProtocol": APP_PROTOCOL}
    ]
    got = {e["targetRef"]["name"]: (e["addresses"], e["conditions"]) for e in slice_["endpoints"]}
    assert got == {
        "gw-a": (["10.0.0.6"], {"ready": True, "serving": True, "terminating": False}),
        "gw-b": (["10.0.0.7"], {"ready": False, "serving": False, "terminating": False}),
        "gw-c": (["10.0.0.8"], {"ready": False, "serving": True, "terminating": True}),
    }
    assert [e["targetRef"]["name"] for e in slice_["endpoints"]] == ["gw-a", "gw-b", "gw-c"]
    assert all(e["targetRef"]["namespace"] == GW and e["nodeName"] == "node-1" for e in slice_["endpoints"])


def test_a_dual_stack_pod_is_listed_by_its_ipv4_address():
    pod = _pod("gw", "fd00::2")
    pod["status"]["podIPs"].append({"ip": "10.0.0.3"})
    assert gateway_endpoints([pod], GW)[0]["addresses"] == ["10.0.0.3"]


def _as_observed(obj: dict) -> dict:
    """What the API server gives back: defaults added, an empty list as null."""
    observed = json.loads(json.dumps(obj))
    observed["metadata"]["uid"] = "x"
    if observed["kind"] == "Service":
        observed["spec"]["clusterIP"] = "10.96.0.9"
        observed["spec"]["sessionAffinity"] = "None"
    elif not observed["endpoints"]:
        observed["endpoints"] = None
    return observed


def test_nothing_is_applied_when_both_match_and_each_drift_is_corrected():
    pods = [_pod("gw-a")]
    svc, slice_ = picker_service("team-a", OWNERS), picker_slice("team-a", OWNERS, pods, GW)
    first = plan_namespace("team-a", OWNERS, pods, CONFIG, None, None)
    assert [o["kind"] for o in first.apply] == ["Service", "EndpointSlice"]
    assert first.apply == [svc, slice_]
    assert plan_namespace("team-a", OWNERS, pods, CONFIG, _as_observed(svc), _as_observed(slice_)).apply == []
    # An empty slice (no gateway pod) comes back with endpoints null: still a match.
    empty = picker_slice("team-a", OWNERS, [], GW)
    assert plan_namespace("team-a", OWNERS, [], CONFIG, _as_observed(svc), _as_observed(empty)).apply == []
    # A gateway pod came: the slice only.
    moved = plan_namespace("team-a", OWNERS, [*pods, _pod("gw-b", "10.0.0.9")], CONFIG, _as_observed(svc),
                           _as_observed(slice_))  # fmt: skip
    assert [o["kind"] for o in moved.apply] == ["EndpointSlice"]
    # A service of the namespace went: both, with its owner reference gone.
    fewer = plan_namespace("team-a", OWNERS[:1], pods, CONFIG, _as_observed(svc), _as_observed(slice_))
    assert [o["kind"] for o in fewer.apply] == ["Service", "EndpointSlice"]
    assert all(len(o["metadata"]["ownerReferences"]) == 1 for o in fewer.apply)
    # Someone edited the port.
    edited = _as_observed(svc)
    edited["spec"]["ports"][0]["port"] = 9003
    assert [o["kind"] for o in plan_namespace("team-a", OWNERS, pods, CONFIG, edited, _as_observed(slice_)).apply] == [
        "Service"
    ]  # fmt: skip


def test_no_services_left_means_nothing_applied_the_garbage_collector_removes_them():
    svc = _as_observed(picker_service("team-a", OWNERS))
    assert plan_namespace("team-a", [], [_pod("gw-a")], CONFIG, svc, None).apply == []


def test_a_service_someone_else_made_is_never_adopted():
    pods = [_pod("gw-a")]
    theirs = {"metadata": {"name": GATEWAY_SERVICE, "labels": {"app": "mine"}},
              "spec": {"ports": [{"port": 9002}], "selector": {"app": "mine"}}}  # fmt: skip
    # Our labels copied onto a Service with a selector (which would add its own endpoints): not ours either.
    spoofed = _as_observed(picker_service("team-a", OWNERS))
    spoofed["spec"]["selector"] = {"app": "mine"}
    chart = {"metadata": {"name": GATEWAY_SERVICE, "labels": {"app.kubernetes.io/managed-by": "Helm"}},
             "spec": {"ports": [{"port": 80}], "selector": {"app.kubernetes.io/name": "flotilla-gateway"}}}  # fmt: skip
    for observed in (theirs, spoofed, chart):
        result = plan_namespace("team-a", OWNERS, pods, CONFIG, observed, None)
        assert result.apply == [] and result.foreign, observed
        assert not is_ours(observed)
    # The pools report on that Service as on any: the existing messages.
    ok, _, message = resolved_refs("team-a", picker_ports(chart))
    assert not ok and "has no port 9002" in message
    ok, _, message = resolved_refs("team-a", None)
    assert not ok and "does not exist in namespace team-a" in message


def test_plan_all_covers_the_namespaces_asked_for_even_without_services():
    services = [_isvc("team-a", "chat"), _isvc("team-b", "embed")]
    everywhere = plan_all(services, [_pod("gw-a")], CONFIG, {}, {})
    assert [p.namespace for p in everywhere] == ["team-a", "team-b"]
    assert all(len(p.apply) == 2 for p in everywhere)
    (gone,) = plan_all(services, [], CONFIG, {}, {}, ["team-z"])
    assert gone.namespace == "team-z" and gone.apply == []


def test_rbac_allows_the_writes_and_limits_slices_by_name():
    rules = cluster_rules()
    slices = [r for r in rules if "endpointslices" in r["resources"]]
    assert {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"]} in slices  # fmt: skip
    assert {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "resourceNames": [SLICE_NAME],
            "verbs": ["create", "patch"]} in slices  # fmt: skip
    assert not any("delete" in r["verbs"] for r in slices)
    services = [r for r in rules if r["apiGroups"] == [""] and "services" in r["resources"]]
    assert {"create", "patch", "watch"} <= set(services[0]["verbs"])


# ---------------------------------------------------------------------------------------------------
# The kopf layer's round, over a fake client


class FakeKube:
    def __init__(self, fail: ApiException | None = None):
        self.applied: list[dict] = []
        self.fail = fail

    def apply(self, obj: dict) -> None:
        if self.fail is not None:
            raise self.fail
        self.applied.append(obj)


def _idx(services=(), pods=(), picker_services=None, picker_slices=None) -> dict:
    def by(key, objs):
        out: dict = {}
        for obj in objs:
            out.setdefault(key(obj), []).append(obj)
        return out

    return {
        "services": by(lambda o: (o["metadata"]["namespace"], o["metadata"]["name"]), services),
        "gateway_pods": by(lambda o: o["metadata"]["name"], pods),
        "picker_services": {ns: [o] for ns, o in (picker_services or {}).items()},
        "picker_slices": {ns: [o] for ns, o in (picker_slices or {}).items()},
    }


def _runtime(kube: FakeKube) -> Runtime:
    return Runtime(config=CONFIG, kube=kube)  # type: ignore[arg-type]


def test_a_round_applies_each_namespaces_service_then_slice():
    kube = FakeKube()
    rt = _runtime(kube)
    idx = _idx([_isvc("team-a", "chat"), _isvc("team-b", "embed")], [_pod("gw-a")])
    sync_pickers(rt, idx, None, "test")
    assert [(o["kind"], o["metadata"]["namespace"]) for o in kube.applied] == [
        ("Service", "team-a"), ("EndpointSlice", "team-a"), ("Service", "team-b"), ("EndpointSlice", "team-b"),
    ]  # fmt: skip
    # Observed as applied: nothing more.
    kube.applied.clear()
    idx = _idx(
        [_isvc("team-a", "chat")],
        [_pod("gw-a")],
        {"team-a": _as_observed(picker_service("team-a", [ServiceRef("chat", "uid-chat")]))},
        {
            "team-a": _as_observed(
                picker_slice("team-a", [ServiceRef("chat", "uid-chat")], [_pod("gw-a")], GW)
            )
        },
    )
    sync_pickers(rt, idx, ["team-a"], "test")
    assert kube.applied == []


def test_a_foreign_service_is_remembered_and_a_refusal_does_not_raise():
    kube = FakeKube()
    rt = _runtime(kube)
    foreign = {"metadata": {}, "spec": {"ports": [{"port": 80}], "selector": {"app": "x"}}}
    sync_pickers(rt, _idx([_isvc("team-a", "chat")], [], {"team-a": foreign}), ["team-a"], "test")
    assert kube.applied == [] and rt.foreign_pickers == {"team-a"}
    sync_pickers(rt, _idx([_isvc("team-a", "chat")], []), ["team-a"], "test")
    assert rt.foreign_pickers == set() and len(kube.applied) == 2
    refused = ApiException(status=403, reason="Forbidden")
    refused.body = json.dumps({"message": "forbidden"})
    sync_pickers(_runtime(FakeKube(refused)), _idx([_isvc("team-a", "chat")], []), None, "test")


def test_indexes_readers_take_one_object_per_key():
    from flotilla.operator.controllers.indexes import index_all, index_firsts

    index = {"a": [{"n": 1}], "b": [{"n": 2}, {"n": 3}]}
    assert index_all(index) == [{"n": 1}, {"n": 2}, {"n": 3}]  # type: ignore[arg-type]
    assert index_firsts(index) == {"a": {"n": 1}, "b": {"n": 2}}  # type: ignore[arg-type]
