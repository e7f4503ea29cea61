"""One reconcile as a pure function: children, status and events from an object and a World."""

from __future__ import annotations

from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.reconcile import World, plan, status_changed
from flotilla.operator.tenancy.quota import Held

NOW = "2026-01-01T00:00:00Z"


def _obj(spec, status=None, generation=1):
    return {
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1", "generation": generation},
        "spec": spec,
        "status": status or {},
    }


def _world(**kw):
    base = dict(
        config=OperatorConfig(host_path_roots=("/models",)),
        now=NOW,
        gpu_types={"h100"},
        tenants={"team-a": TenantSpec(namespaces=["team-a"], gpu_quota={"h100": 4})},
        held_by_others=[],
        deployment=None,
        pods=[],
        path_exists=lambda _p: True,
    )
    base.update(kw)
    return World(**base)


SPEC = {"model": {"uri": "file:///models/tiny"}, "resources": {"gpus": 1, "gpuType": "h100"}, "replicas": 2}


def _conds(p):
    return {c["type"]: c for c in p.status["conditions"]}


def test_valid_service_gets_children_and_holds_its_gpus():
    p = plan(_obj(SPEC), _world())
    assert [c["kind"] for c in p.children] == [
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "InferencePool",
    ]
    assert p.children[0]["spec"]["replicas"] == 2
    assert p.held == Held(("team-a", "chat"), "team-a", "h100", 2)
    assert _conds(p)["QuotaAdmitted"]["status"] == "True"
    assert p.events == []


def test_invalid_service_gets_nothing_and_one_warning():
    spec = {**SPEC, "resources": {"gpus": 1, "gpuType": "a100"}}
    p = plan(_obj(spec), _world())
    assert p.children == [] and p.held is None
    assert [(e.type, e.reason) for e in p.events] == [("Warning", "UnknownGPUType")]
    # The next reconcile of the same object does not repeat the warning.
    again = plan(_obj(spec, status=p.status), _world())
    assert again.events == []


def test_quota_holds_back_and_warns():
    p = plan(
        _obj({**SPEC, "replicas": 3}), _world(held_by_others=[Held(("team-a", "other"), "team-a", "h100", 2)])
    )
    assert p.children[0]["spec"]["replicas"] == 2
    c = _conds(p)
    assert c["QuotaAdmitted"]["status"] == "False"
    assert "tenant team-a" in c["QuotaAdmitted"]["message"]
    assert ("Warning", "QuotaExceeded") in [(e.type, e.reason) for e in p.events]


def test_other_tenants_do_not_count():
    p = plan(_obj(SPEC), _world(held_by_others=[Held(("team-b", "other"), "team-b", "h100", 4)]))
    assert _conds(p)["QuotaAdmitted"]["status"] == "True"


def test_ready_deployment_makes_ready_status_and_a_normal_event():
    dep = {
        "metadata": {"generation": 1},
        "spec": {"replicas": 2},
        "status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 1},
    }
    pods = [
        {
            "metadata": {"name": f"chat-{i}"},
            "status": {"podIP": f"127.0.1.{i}", "conditions": [{"type": "Ready", "status": "True"}]},
        }
        for i in (1, 2)
    ]
    p = plan(_obj(SPEC), _world(deployment=dep, pods=pods))
    assert _conds(p)["Ready"]["status"] == "True"
    assert [(e.type, e.reason) for e in p.events] == [("Normal", "Ready")]


def test_status_changed_ignores_transition_times():
    p = plan(_obj(SPEC), _world())
    later = plan(_obj(SPEC), _world(now="2026-01-02T00:00:00Z"))
    assert not status_changed(p.status, later.status)
    assert status_changed({}, p.status)


def test_status_written_by_others_is_not_a_change():
    p = plan(_obj(SPEC), _world())
    assert not status_changed({**p.status, "autoscaling": {"desiredReplicas": 3}}, p.status)


def test_a_namespace_selected_by_labels_is_held_to_that_tenants_quota():
    selecting = TenantSpec.model_validate(
        {"namespaceSelector": {"matchLabels": {"team": "ml"}}, "gpuQuota": {"h100": 1}}
    )
    world = _world(tenants={"ml": selecting}, namespace_labels={"team-a": {"team": "ml"}})
    p = plan(_obj(SPEC), world)
    assert p.children[0]["spec"]["replicas"] == 1 and p.held == Held(("team-a", "chat"), "ml", "h100", 1)
    assert "tenant ml" in _conds(p)["QuotaAdmitted"]["message"]

    unlabelled = plan(_obj(SPEC), _world(tenants={"ml": selecting}, namespace_labels={"team-a": {}}))
    assert _conds(unlabelled)["QuotaAdmitted"]["reason"] == "NoTenant"
