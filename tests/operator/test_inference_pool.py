"""The InferencePool each InferenceService gets, and the operator's entry in its status: pure functions,
checked against the standard's own CRD (the pinned release's schema, as installed)."""

from __future__ import annotations

import re

import pytest

from flotilla.contract import ENGINE_PORT, GATEWAY_SERVICE, PICKER_PORT
from flotilla.operator.api import inference_extension as gie
from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.drift import drifted
from flotilla.operator.desired.inference_pool import (
    CONTROLLER_NAME,
    inference_pool,
    parent_ref,
    pool_status,
)
from flotilla.operator.desired.reconcile import World, plan
from flotilla.operator.desired.workload import Decision, Owner, deployment
from flotilla.operator.manifests.crds import inference_pool_crd
from flotilla.operator.naming import SERVICE_LABEL

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"
OWNER = Owner(name="chat", namespace="team-a", uid="0b5c-uid")
DECISION = Decision(tenant="team-a", replicas=2)
CONFIG = OperatorConfig(host_path_roots=("/models",))
PICKER = {"metadata": {"name": GATEWAY_SERVICE}, "spec": {"ports": [{"name": "grpc", "port": PICKER_PORT}]}}


def _schema() -> dict:
    (version,) = inference_pool_crd()["spec"]["versions"]
    assert version["name"] == gie.VERSION
    return version["schema"]["openAPIV3Schema"]


def _violations(value, schema: dict, path: str = "") -> list[str]:
    """What the CRD's OpenAPI schema refuses in `value`: types, required fields, unknown fields, enums,
    bounds and patterns (the API server checks the same, and prunes unknown fields silently)."""
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            return [f"{path}: not an object"]
        out = [f"{path}.{key}: required" for key in schema.get("required", []) if key not in value]
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                out += _violations(item, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += _violations(item, extra, f"{path}.{key}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{path}.{key}: unknown field")
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            out.append(f"{path}: fewer than {schema['minProperties']} properties")
        return out
    if kind == "array":
        if not isinstance(value, list):
            return [f"{path}: not a list"]
        out = [v for i, item in enumerate(value) for v in _violations(item, schema["items"], f"{path}[{i}]")]
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            out.append(f"{path}: {len(value)} items")
        return out
    types = {"string": str, "integer": int, "boolean": bool}
    if kind in types and (
        not isinstance(value, types[kind]) or isinstance(value, bool) != (kind == "boolean")
    ):
        return [f"{path}: not a {kind}"]
    out = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not in {schema['enum']}")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        out.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get(
        "maxLength", 1 << 30
    ):
        out.append(f"{path}: length {len(value)}")
    if isinstance(value, int) and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        out.append(f"{path}: {value} out of bounds")
    return out


def _observed(pool: dict, status: dict | None = None, generation: int = 1, version: str = "41") -> dict:
    """The pool as the API server returns it: with a generation, a resourceVersion, and defaults."""
    meta = {**pool["metadata"], "generation": generation, "resourceVersion": version, "uid": "pool-uid"}
    return {**pool, "metadata": meta, "status": status or {}}


def _write_back(observed: dict, write) -> dict:
    return {**observed, "status": write.status}


def _conditions(entry: dict) -> dict[str, dict]:
    return {c["type"]: c for c in entry["conditions"]}


# -- the pool's spec -------------------------------------------------------------------------------------


def test_pool_is_named_like_the_service_and_owned_by_it():
    pool = inference_pool(OWNER, DECISION)
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    meta = pool["metadata"]
    assert (meta["name"], meta["namespace"]) == ("chat", "team-a")
    (ref,) = meta["ownerReferences"]
    assert ref == {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "chat",
        "uid": "0b5c-uid",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    # The operator's watches find it by the labels every child carries.
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "flotilla"
    assert meta["labels"][SERVICE_LABEL] == "chat"


def test_pool_selects_the_engine_pods_on_the_engine_port(make_spec):
    pool = inference_pool(OWNER, DECISION)["spec"]
    dep = deployment(OWNER, make_spec(), DECISION, CONFIG)["spec"]
    # The Deployment's own selector: its pods, whichever tenant label they carry.
    assert pool["selector"] == dep["selector"] == {"matchLabels": {SERVICE_LABEL: "chat"}}
    assert pool["selector"]["matchLabels"].items() <= dep["template"]["metadata"]["labels"].items()
    (port,) = dep["template"]["spec"]["containers"][0]["ports"]
    assert pool["targetPorts"] == [{"number": port["containerPort"]}] == [{"number": ENGINE_PORT}]
    assert pool["appProtocol"] == "http"
    assert inference_pool(OWNER, Decision("", 1))["spec"]["selector"] == pool["selector"]


def test_pool_names_flotillas_picker_and_fails_closed():
    assert inference_pool(OWNER, DECISION)["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": GATEWAY_SERVICE,
        "port": {"number": PICKER_PORT},
        "failureMode": "FailClose",
    }


def test_pool_is_valid_under_the_standards_schema():
    pool = inference_pool(OWNER, DECISION)
    assert _violations(pool, _schema()) == []
    # The validator sees what the API server would refuse (or prune).
    assert _violations({**pool, "spec": {**pool["spec"], "targetPort": 8000}}, _schema())
    assert _violations({**pool, "spec": {**pool["spec"], "targetPorts": []}}, _schema())


def test_pool_with_api_server_defaults_has_not_drifted():
    pool = inference_pool(OWNER, DECISION)
    observed = _observed(pool, {"parents": []})
    observed["metadata"]["labels"] = {**pool["metadata"]["labels"], "extra": "kept"}
    assert drifted(observed, pool) == []
    changed = {**observed, "spec": {**observed["spec"], "targetPorts": [{"number": 9000}]}}
    assert drifted(changed, pool) == ["spec.targetPorts"]


# -- the plan --------------------------------------------------------------------------------------------

SPEC = {"model": {"uri": "file:///models/tiny"}, "resources": {"gpus": 1, "gpuType": "h100"}, "replicas": 2}


def _obj(spec=None) -> dict:
    return {
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "0b5c-uid", "generation": 1},
        "spec": spec or SPEC,
        "status": {},
    }


def _world(**kw) -> World:
    base = dict(
        config=CONFIG,
        now=NOW,
        gpu_types={"h100"},
        tenants={"team-a": TenantSpec(namespaces=["team-a"], gpu_quota={"h100": 4})},
        held_by_others=[],
        deployment=None,
        path_exists=lambda _p: True,
    )
    base.update(kw)
    return World(**base)


def test_plan_applies_the_pool_after_the_workload():
    p = plan(_obj(), _world())
    assert p.children[-1] == inference_pool(OWNER, DECISION)
    assert p.pool_status is None  # nothing to write until the pool exists


def test_no_pool_when_turned_off_or_for_an_invalid_spec():
    off = plan(_obj(), _world(config=OperatorConfig(host_path_roots=("/models",), inference_pools=False)))
    assert "InferencePool" not in [c["kind"] for c in off.children]
    observed = _observed(inference_pool(OWNER, DECISION))
    assert (
        plan(
            _obj(),
            _world(
                config=OperatorConfig(host_path_roots=("/models",), inference_pools=False),
                inference_pool=observed,
            ),
        ).pool_status
        is None
    )
    invalid = plan(
        _obj({**SPEC, "resources": {"gpus": 1, "gpuType": "a100"}}), _world(inference_pool=observed)
    )
    assert invalid.children == [] and invalid.pool_status is None


def test_plan_writes_the_status_of_the_observed_pool():
    observed = _observed(inference_pool(OWNER, DECISION), version="77")
    write = plan(_obj(), _world(inference_pool=observed, picker_service=PICKER)).pool_status
    assert write is not None
    assert (write.namespace, write.name, write.resource_version) == ("team-a", "chat", "77")
    (entry,) = write.status["parents"]
    assert entry["controllerName"] == CONTROLLER_NAME
    assert _conditions(entry)["ResolvedRefs"]["status"] == "True"


# -- the status entry ------------------------------------------------------------------------------------


def test_the_entry_is_flotillas_gateway_accepting_the_pool():
    write = pool_status(OWNER, _observed(inference_pool(OWNER, DECISION), generation=3), PICKER, CONFIG, NOW)
    assert write is not None
    (entry,) = write.status["parents"]
    assert entry["parentRef"] == {
        "group": "",
        "kind": "Service",
        "name": GATEWAY_SERVICE,
        "namespace": "flotilla-system",
    }
    assert entry["parentRef"] == parent_ref(CONFIG)
    accepted = _conditions(entry)["Accepted"]
    assert (accepted["status"], accepted["reason"]) == ("True", "Accepted")
    assert "InferenceService chat" in accepted["message"]
    resolved = _conditions(entry)["ResolvedRefs"]
    assert (resolved["status"], resolved["reason"]) == ("True", "ResolvedRefs")
    for cond in entry["conditions"]:
        assert cond["observedGeneration"] == 3 and cond["lastTransitionTime"] == NOW


def test_the_gateways_namespace_comes_from_the_config():
    config = OperatorConfig(gateway_namespace="flotilla")
    write = pool_status(OWNER, _observed(inference_pool(OWNER, DECISION)), PICKER, config, NOW)
    assert write is not None
    assert write.status["parents"][0]["parentRef"]["namespace"] == "flotilla"


@pytest.mark.parametrize(
    ("picker", "says"),
    [
        (None, f"Service {GATEWAY_SERVICE} does not exist in namespace team-a"),
        (
            {"spec": {"ports": [{"name": "http", "port": 80}]}},
            f"has no port {PICKER_PORT} (the picker's; it has 80)",
        ),
    ],
    ids=["no-service", "no-port"],
)
def test_an_unresolved_picker_is_an_invalid_extension_ref(picker, says):
    write = pool_status(OWNER, _observed(inference_pool(OWNER, DECISION)), picker, CONFIG, NOW)
    assert write is not None
    conditions = _conditions(write.status["parents"][0])
    resolved = conditions["ResolvedRefs"]
    assert (resolved["status"], resolved["reason"]) == ("False", "InvalidExtensionRef")
    assert says in resolved["message"]
    assert conditions["Accepted"]["status"] == "True"


def test_the_status_is_valid_under_the_standards_schema():
    schema = _schema()["properties"]["status"]
    for picker in (PICKER, None):
        write = pool_status(OWNER, _observed(inference_pool(OWNER, DECISION)), picker, CONFIG, NOW)
        assert write is not None
        assert _violations(write.status, schema) == []
    assert _violations({"parents": [{"controllerName": "no-path"}]}, schema)


def test_a_written_status_is_not_written_again():
    observed = _observed(inference_pool(OWNER, DECISION))
    write = pool_status(OWNER, observed, PICKER, CONFIG, NOW)
    assert write is not None
    assert pool_status(OWNER, _write_back(observed, write), PICKER, CONFIG, LATER) is None


def test_transition_times_move_only_with_the_status():
    observed = _observed(inference_pool(OWNER, DECISION))
    first = pool_status(OWNER, observed, None, CONFIG, NOW)
    assert first is not None
    second = pool_status(OWNER, _write_back(observed, first), PICKER, CONFIG, LATER)
    assert second is not None
    conditions = _conditions(second.status["parents"][0])
    assert conditions["ResolvedRefs"]["lastTransitionTime"] == LATER
    assert conditions["Accepted"]["lastTransitionTime"] == NOW


def test_a_spec_change_is_observed_in_the_entry():
    observed = _observed(inference_pool(OWNER, DECISION), generation=1)
    first = pool_status(OWNER, observed, PICKER, CONFIG, NOW)
    assert first is not None
    newer = _observed(inference_pool(OWNER, DECISION), dict(first.status), generation=2)
    second = pool_status(OWNER, newer, PICKER, CONFIG, LATER)
    assert second is not None
    for cond in second.status["parents"][0]["conditions"]:
        assert cond["observedGeneration"] == 2 and cond["lastTransitionTime"] == NOW


def _other(name: str) -> dict:
    return {
        "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": name},
        "controllerName": "istio.io/gateway-controller",
        "conditions": [
            {"type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
             "lastTransitionTime": NOW},
        ],
    }  # fmt: skip


def test_other_controllers_entries_are_kept_in_place():
    istio, kgateway = _other("istio"), {**_other("kgw"), "controllerName": "kgateway.dev/kgateway"}
    observed = _observed(inference_pool(OWNER, DECISION), {"parents": [istio, kgateway]})
    write = pool_status(OWNER, observed, PICKER, CONFIG, NOW)
    assert write is not None
    assert write.status["parents"][:2] == [istio, kgateway]
    assert write.status["parents"][2]["controllerName"] == CONTROLLER_NAME
    # Ours is updated where it stands; a duplicate of ours goes.
    mine = write.status["parents"][2]
    stale = {**mine, "conditions": mine["conditions"][:1]}
    again = _observed(inference_pool(OWNER, DECISION), {"parents": [istio, stale, kgateway, stale]})
    rewrite = pool_status(OWNER, again, PICKER, CONFIG, LATER)
    assert rewrite is not None
    first, ours, last = rewrite.status["parents"]
    assert (first, last) == (istio, kgateway)
    assert _conditions(ours)["Accepted"] == _conditions(mine)["Accepted"]  # unchanged, time kept
    assert _conditions(ours)["ResolvedRefs"]["lastTransitionTime"] == LATER  # it was missing


def test_no_room_among_32_other_parents_means_no_write():
    others = [_other(f"gw-{i}") for i in range(gie.MAX_PARENTS)]
    observed = _observed(inference_pool(OWNER, DECISION), {"parents": others})
    assert pool_status(OWNER, observed, PICKER, CONFIG, NOW) is None
