"""Specs valid in shape but wrong in meaning get a clear problem naming the field."""

from __future__ import annotations

from flotilla.operator.desired.validation import parse_spec, validate

GPU_TYPES = {"h100", "l4"}


def _problems(spec, *, exists=True, gpu_types=GPU_TYPES):
    return validate(spec, gpu_types=gpu_types, path_exists=lambda _path: exists)


def test_a_good_spec_has_no_problems(make_spec):
    assert _problems(make_spec()) == []


def test_min_above_max(make_spec):
    (p,) = _problems(make_spec(autoscaling={"minReplicas": 5, "maxReplicas": 2}))
    assert p.field == "spec.autoscaling" and p.reason == "InvalidReplicaRange"
    assert "minReplicas (5) is greater than maxReplicas (2)" in p.message


def test_unknown_scheme(make_spec):
    (p,) = _problems(make_spec(model={"uri": "s3://bucket/m"}))
    assert p.field == "spec.model.uri" and p.reason == "InvalidModelUri"
    assert "'s3'" in p.message and "file://" in p.message


def test_missing_model_path(make_spec):
    (p,) = _problems(make_spec(), exists=False)
    assert p.reason == "ModelNotFound" and "/models/tiny-llama does not exist" in p.message


def test_path_not_checked_when_it_cannot_be(make_spec):
    assert validate(make_spec(), gpu_types=GPU_TYPES, path_exists=None) == []


def test_gpu_type_no_node_has(make_spec):
    (p,) = _problems(make_spec(resources={"gpus": 1, "gpuType": "a100"}))
    assert p.field == "spec.resources.gpuType" and p.reason == "UnknownGPUType"
    assert "'a100'" in p.message and "h100, l4" in p.message


def test_gpu_type_with_no_gpu_nodes_at_all(make_spec):
    (p,) = _problems(make_spec(), gpu_types=set())
    assert "types on nodes: none" in p.message


def test_all_problems_are_reported_together(make_spec):
    spec = make_spec(
        model={"uri": "ftp://x/y"},
        resources={"gpus": 1, "gpuType": "a100"},
        autoscaling={"minReplicas": 3, "maxReplicas": 1},
    )
    assert [p.reason for p in _problems(spec)] == ["InvalidReplicaRange", "InvalidModelUri", "UnknownGPUType"]


def test_parse_spec_reports_schema_problems_by_field():
    spec, problems = parse_spec({"model": {"uri": "file:///m"}, "replicas": -2})
    assert spec is None
    assert problems[0].field == "spec.replicas" and problems[0].reason == "InvalidSpec"
