"""Tenant-fair scheduling, the operator's half: spec.engine.schedulingPolicy and the Tenants'
schedulingWeight become the engine's --scheduling-policy and --tenant-weights, for fair engines only."""

from __future__ import annotations

from typing import get_args

import kopf
import pytest
from pydantic import ValidationError

from flotilla import contract
from flotilla.operator.api.v1alpha1 import EngineSettings, TenantSpec
from flotilla.operator.config import OperatorConfig
from flotilla.operator.controllers import cluster_events, indexes
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.desired.reconcile import World, plan, uses_tenant_weights
from flotilla.operator.desired.validation import parse_spec
from flotilla.operator.desired.workload import Decision, deployment, engine_args
from flotilla.operator.tenancy.rules import scheduling_weights

WEIGHTS = (("team-b", 0.5), ("team-c", 3.0))
TENANTS = {
    "team-c": TenantSpec(namespaces=["team-c"], scheduling_weight=3),
    "team-a": TenantSpec(namespaces=["team-a"], gpu_quota={"h100": 4}),  # weight 1: left out
    "team-b": TenantSpec(namespaces=["team-b"], scheduling_weight=0.5),
}


def _command(dep: dict) -> list[str]:
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container["command"]


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_the_api_offers_the_contracts_policies():
    (policies, _none) = get_args(EngineSettings.model_fields["scheduling_policy"].annotation)
    assert get_args(policies) == contract.SCHEDULING_POLICIES


@pytest.mark.parametrize("policy", contract.SCHEDULING_POLICIES)
def test_engine_args_maps_the_scheduling_policy(policy):
    engine = EngineSettings.model_validate({"schedulingPolicy": policy})
    assert engine_args(engine).scheduling_policy == policy
    assert engine_args(engine).flags() == ["--scheduling-policy", policy]


def test_no_policy_keeps_the_engines_default():
    assert engine_args(EngineSettings()).scheduling_policy is None
    assert "--scheduling-policy" not in engine_args(EngineSettings(), WEIGHTS).flags()


def test_weights_are_the_tenants_not_of_weight_one_sorted_by_name():
    assert scheduling_weights(TENANTS) == WEIGHTS
    assert scheduling_weights({"team-a": TenantSpec()}) == ()


def test_a_fair_service_gets_the_tenant_weights(owner, config, make_spec):
    spec = make_spec(engine={"schedulingPolicy": "fair"})
    command = _command(deployment(owner, spec, Decision("team-a", 2, WEIGHTS), config))
    assert _flag(command, "--scheduling-policy") == "fair"
    assert _flag(command, "--tenant-weights") == "team-b=0.5,team-c=3"


@pytest.mark.parametrize("policy", [None, "fcfs", "priority"])
def test_other_policies_get_no_tenant_weights(owner, config, make_spec, policy):
    spec = make_spec(engine={"schedulingPolicy": policy} if policy else {})
    command = _command(deployment(owner, spec, Decision("team-a", 2, WEIGHTS), config))
    assert _flag(command, "--scheduling-policy") == policy
    assert "--tenant-weights" not in command


def _obj(engine: dict) -> dict:
    return {
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1", "generation": 1},
        "spec": {"model": {"uri": "file:///models/tiny"}, "resources": {"gpus": 1, "gpuType": "h100"},
                 "replicas": 1, "engine": engine},
    }  # fmt: skip


def _world(tenants) -> World:
    return World(config=OperatorConfig(host_path_roots=("/models",)), now="2026-01-01T00:00:00Z",
                 gpu_types={"h100"}, tenants=tenants, held_by_others=[], deployment=None,
                 path_exists=lambda _p: True)  # fmt: skip


def test_the_plan_renders_every_tenants_weight_for_fair_services_only():
    fair = plan(_obj({"schedulingPolicy": "fair"}), _world(TENANTS))
    assert _flag(_command(fair.children[0]), "--tenant-weights") == "team-b=0.5,team-c=3"
    fcfs = plan(_obj({"schedulingPolicy": "fcfs"}), _world(TENANTS))
    assert "--tenant-weights" not in _command(fcfs.children[0])
    # No Tenant weighs other than 1: the fair engine gets no weights (all weigh 1 there too).
    plain = plan(_obj({"schedulingPolicy": "fair"}), _world({"team-a": TENANTS["team-a"]}))
    assert "--tenant-weights" not in _command(plain.children[0])


def test_a_bad_policy_is_refused_naming_the_field_and_the_value():
    spec, problems = parse_spec({"model": {"uri": "file:///m"}, "engine": {"schedulingPolicy": "lottery"}})
    assert spec is None
    (p,) = problems
    assert p.field == "spec.engine.schedulingPolicy" and p.reason == "InvalidSpec"
    assert "'lottery'" in p.message and "'fair'" in p.message


@pytest.mark.parametrize("weight", [0, -1, 1001])
def test_a_bad_weight_is_refused_naming_the_field_and_the_value(weight):
    with pytest.raises(ValidationError) as refused:
        TenantSpec.model_validate({"namespaces": ["team-a"], "schedulingWeight": weight})
    # The Tenant webhook refuses with this text (controllers/webhook_reviews.py).
    assert "schedulingWeight" in str(refused.value) and f"input_value={weight}" in str(refused.value)


def test_a_weight_defaults_to_one_and_may_be_fractional():
    assert TenantSpec().scheduling_weight == 1.0
    assert TenantSpec.model_validate({"schedulingWeight": 0.25}).scheduling_weight == 0.25


# ---------------------------------------------------------------------------------------------------
# The Tenant watch: which services a Tenant event re-plans.


def _service(namespace: str, name: str, policy: str | None) -> dict:
    engine = {"schedulingPolicy": policy} if policy else {}
    return {"metadata": {"namespace": namespace, "name": name}, "spec": {"engine": engine}, "status": {}}


SERVICES = [
    _service("team-a", "own", "fcfs"),  # in the Tenant's namespace
    _service("team-x", "fair", "fair"),  # elsewhere, fair
    _service("team-x", "fcfs", None),  # elsewhere, default policy
]


def _retried(monkeypatch, rt: Runtime, spec: dict, event_type: str | None = "MODIFIED") -> list[str]:
    """The services one Tenant event re-plans (retry_services' predicate, applied to SERVICES)."""
    picked: list[str] = []

    def fake_retry(_rt, _idx, wanted, _trigger):
        picked.extend(s["metadata"]["name"] for s in SERVICES if wanted(s, {}))

    monkeypatch.setattr(cluster_events, "retry_services", fake_retry)
    empty = {name: {} for name in indexes.NAMES}
    cluster_events.tenant_event(
        name="team-a", spec=spec, memo=kopf.Memo(runtime=rt), type=event_type, **empty
    )
    return picked


def test_a_weight_change_replans_fair_services_in_every_namespace(monkeypatch):
    rt = Runtime(config=OperatorConfig(), kube=None)  # type: ignore[arg-type]  # the fake retry calls no API
    spec = {"namespaces": ["team-a"]}
    assert _retried(monkeypatch, rt, spec, None) == ["own"]  # first seen at weight 1: as before
    assert _retried(monkeypatch, rt, {**spec, "schedulingWeight": 2}) == ["own", "fair"]
    assert _retried(monkeypatch, rt, {**spec, "schedulingWeight": 2}) == ["own"]  # e.g. a status update
    assert _retried(monkeypatch, rt, {**spec, "schedulingWeight": 2}, "DELETED") == ["own", "fair"]
    assert rt.tenant_weights == {}


def test_which_services_use_the_weights():
    assert [uses_tenant_weights(s) for s in SERVICES] == [False, True, False]
    assert not uses_tenant_weights({"metadata": {}, "spec": None})
