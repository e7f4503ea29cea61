from __future__ import annotations

from flotilla.operator.desired.drift import contains, drifted


def test_server_defaults_are_not_drift():
    desired = {"spec": {"ports": [{"name": "http", "port": 8000}]}, "metadata": {"labels": {"a": "1"}}}
    observed = {
        "spec": {"ports": [{"name": "http", "port": 8000, "protocol": "TCP"}], "clusterIP": "10.0.0.1"},
        "metadata": {"labels": {"a": "1", "extra": "x"}, "uid": "u"},
    }
    assert drifted(observed, desired) == []


def test_edited_fields_are_drift():
    desired = {"spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "engine"}]}}}}
    observed = {
        "spec": {"replicas": 5, "template": {"spec": {"containers": [{"name": "engine"}, {"name": "x"}]}}}
    }
    assert drifted(observed, desired) == ["spec.replicas", "spec.template"]


def test_quantities_compare_as_text_and_bools_strictly():
    assert contains({"cpu": 4}, {"cpu": "4"})
    assert not contains(1, True)
    assert not contains(None, {"a": 1})


def test_empty_values_the_server_omits_are_not_drift():
    desired = {"spec": {"env": [{"name": "FLOTILLA_TENANT", "value": ""}], "volumes": []}}
    observed = {"spec": {"env": [{"name": "FLOTILLA_TENANT"}]}}
    assert drifted(observed, desired) == []
