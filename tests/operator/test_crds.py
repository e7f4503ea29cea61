"""The CRDs are generated from the pydantic types: the checked-in files match, and the schema is real."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from flotilla.operator.api import inference_extension as gie
from flotilla.operator.api.v1alpha1 import INFERENCE_SERVICE, TENANT, InferenceServiceSpec, TenantSpec
from flotilla.operator.manifests import crds as crds_module
from flotilla.operator.manifests.crds import (
    GIE_COMMIT,
    GIE_HEADER,
    GIE_PATH,
    GIE_REPOSITORY,
    GIE_VERSION,
    crd,
    crd_files,
    inference_pool_crd_text,
)

CRD_DIR = Path(__file__).resolve().parents[2] / "crds"


@pytest.mark.parametrize("name", sorted(crd_files()))
def test_checked_in_crds_match_the_types(name):
    path = CRD_DIR / name
    assert path.exists(), f"{path} is missing: run `flotilla operator crds`"
    assert path.read_text() == crd_files()[name], (
        f"{path} drifted from operator/src/api.py: run `flotilla operator crds`"
    )


def _walk(node, trail=""):
    if isinstance(node, dict):
        yield trail, node
        for key, value in node.items():
            yield from _walk(value, f"{trail}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{trail}[{i}]")


@pytest.mark.parametrize("kind", [INFERENCE_SERVICE, TENANT], ids=lambda k: k.kind)
def test_schema_is_structural(kind):
    schema = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for trail, node in _walk(schema):
        assert "$ref" not in node and "$defs" not in node, trail
        assert node.get("type") != "null", trail
        assert "title" not in node, trail
        assert not ("properties" in node and "additionalProperties" in node), trail
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True, trail
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, trail


def _spec_schema(kind):
    return crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_inference_service_schema_validates_what_matters():
    spec = _spec_schema(INFERENCE_SERVICE)
    props = spec["properties"]
    assert spec["required"] == ["model"]
    assert props["model"]["required"] == ["uri"]
    assert props["replicas"]["minimum"] == 0 and props["replicas"]["default"] == 1
    assert props["resources"]["properties"]["gpus"]["minimum"] == 0
    assert props["engine"]["properties"]["dtype"]["enum"] == ["auto", "float16", "bfloat16", "float32"]
    assert props["engine"]["properties"]["blockSize"] == {
        "enum": [8, 16, 32],
        "type": "integer",
        "description": "tokens per KV block",
    }
    auto = props["autoscaling"]
    assert auto["required"] == ["maxReplicas"]
    assert auto["properties"]["ttftP95TargetSeconds"]["exclusiveMinimum"] is True
    assert props["resources"]["properties"]["cpu"]["x-kubernetes-int-or-string"] is True


def test_inference_service_crd_has_scale_status_and_columns():
    version = crd(INFERENCE_SERVICE)["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    for wanted in ("Ready", "Replicas", "GPUs", "Model", "Age"):
        assert wanted in columns
    names = crd(INFERENCE_SERVICE)["spec"]["names"]
    assert names["shortNames"] == ["fisvc"]
    assert crd(INFERENCE_SERVICE)["spec"]["scope"] == "Namespaced"
    assert crd(TENANT)["spec"]["scope"] == "Cluster"


def test_conditions_merge_by_type():
    status = crd(INFERENCE_SERVICE)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "status"
    ]
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_design_examples_parse():
    # The two objects DESIGN.md shows users must stay valid.
    InferenceServiceSpec.model_validate(
        {
            "model": {"uri": "file:///models/tiny-llama", "servedName": "tiny-llama"},
            "resources": {"gpus": 1, "gpuType": "h100"},
            "replicas": 1,
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 4,
                "ttftP95TargetSeconds": 0.5,
                "queueDepthTarget": 4,
            },
            "engine": {"maxNumSeqs": 64, "prefixCaching": True},
        }
    )
    tenant = TenantSpec.model_validate(
        {
            "namespaces": ["team-a"],
            "gpuQuota": {"h100": 8},
            "maxServices": 10,
            "pricePerGPUHour": {"h100": 2.5},
            "members": [{"kind": "Group", "name": "team-a-devs"}],
        }
    )
    assert tenant.price_per_gpu_hour == {"h100": 2.5}


@pytest.mark.parametrize(
    "bad",
    [
        {"model": {"uri": "file:///m"}, "replicas": -1},
        {"model": {"uri": "file:///m"}, "engine": {"dtype": "int3"}},
        {"model": {"uri": "file:///m"}, "resources": {"gpuType": "H100 SXM"}},
        {"model": {"uri": "file:///m"}, "unknownField": 1},
        {"resources": {"gpus": 1}},
    ],
)
def test_pydantic_rejects_what_the_crd_rejects(bad):
    with pytest.raises(ValidationError):
        InferenceServiceSpec.model_validate(bad)


def test_crd_files_are_loadable_yaml():
    for text in crd_files().values():
        doc = yaml.safe_load(text)
        assert doc["kind"] == "CustomResourceDefinition"


def test_tenant_rate_limits_are_stored_as_given():
    spec = TenantSpec.model_validate({"rateLimits": {"requestsPerSecond": 2.5, "tokensPerMinute": 60000}})
    assert spec.rate_limits is not None
    assert (spec.rate_limits.requests_per_second, spec.rate_limits.tokens_per_minute) == (2.5, 60000)
    assert spec.to_wire()["rateLimits"] == {"requestsPerSecond": 2.5, "tokensPerMinute": 60000}
    assert TenantSpec().rate_limits is None  # unset: no limit
    props = _spec_schema(TENANT)["properties"]["rateLimits"]["properties"]
    assert (
        props["requestsPerSecond"]["minimum"] == 0 and props["requestsPerSecond"]["exclusiveMinimum"] is True
    )
    assert (props["tokensPerMinute"]["type"], props["tokensPerMinute"]["minimum"]) == ("integer", 1)


@pytest.mark.parametrize(
    ("limits", "field", "says"),
    [
        ({"requestsPerSecond": 0}, "rateLimits.requestsPerSecond", "greater than 0"),
        ({"requestsPerSecond": -1.5}, "rateLimits.requestsPerSecond", "greater than 0"),
        ({"tokensPerMinute": 0}, "rateLimits.tokensPerMinute", "greater than or equal to 1"),
        ({"tokensPerMinute": 1.5}, "rateLimits.tokensPerMinute", "integer"),
        ({"requestsPerMinute": 10}, "rateLimits.requestsPerMinute", "Extra inputs"),
    ],
)
def test_bad_rate_limits_name_the_field(limits, field, says):
    with pytest.raises(ValidationError) as caught:
        TenantSpec.model_validate({"rateLimits": limits})
    (error,) = caught.value.errors()
    assert ".".join(str(p) for p in error["loc"]) == field
    assert says in error["msg"]
    assert field in str(caught.value)


def test_scale_to_zero_after_seconds():
    auto = _spec_schema(INFERENCE_SERVICE)["properties"]["autoscaling"]["properties"]
    assert auto["minReplicas"]["minimum"] == 0
    stz = auto["scaleToZeroAfterSeconds"]
    assert (stz["default"], stz["minimum"], stz["type"]) == (300, 30, "integer")
    base = {"model": {"uri": "file:///m"}, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}
    spec = InferenceServiceSpec.model_validate(base)
    assert spec.autoscaling is not None and spec.autoscaling.scale_to_zero_after_seconds == 300
    with pytest.raises(ValidationError, match="autoscaling.scaleToZeroAfterSeconds"):
        InferenceServiceSpec.model_validate(
            {**base, "autoscaling": {**base["autoscaling"], "scaleToZeroAfterSeconds": 5}}
        )


# The digest of the InferencePool CRD as the pinned release ships it (manifests/gie/README.md says the same).
GIE_SHA256 = "55e0dbf39c50c4bbdd60106493a4573df4bb44479f9ce46762f1af718883e5cd"


def test_the_inference_pool_crd_is_the_pinned_release_unchanged():
    text = inference_pool_crd_text()
    assert hashlib.sha256(text.encode()).hexdigest() == GIE_SHA256, (
        "not the release's file: see gie/README.md"
    )
    crd = yaml.safe_load(text)
    assert crd["metadata"]["name"] == gie.CRD_NAME
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == GIE_VERSION
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"], crd["spec"]["names"]["plural"]) == (
        gie.GROUP,
        gie.KIND,
        gie.PLURAL,
    )
    assert [v["name"] for v in crd["spec"]["versions"]] == [gie.VERSION]
    readme = (Path(crds_module.__file__).parent / "gie" / "README.md").read_text()
    for fact in (GIE_VERSION, GIE_COMMIT, GIE_PATH, GIE_SHA256):
        assert fact in readme


def test_crds_carry_the_inference_pool_crd_with_its_source():
    text = crd_files()[f"{gie.CRD_NAME}.yaml"]
    assert text == GIE_HEADER + inference_pool_crd_text()
    for fact in (GIE_VERSION, GIE_COMMIT, GIE_PATH, GIE_REPOSITORY, "Apache License 2.0"):
        assert fact in GIE_HEADER
