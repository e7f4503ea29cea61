"""Speculative decoding, the operator's half: spec.engine.speculative becomes the engine's
--speculative-* flags, a draft model is mounted beside the served one (its own volume, mount root and
init container), and the combinations that mean nothing are refused naming the field and the value."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flotilla.operator.api.v1alpha1 import INFERENCE_SERVICE, InferenceServiceSpec
from flotilla.operator.config import OperatorConfig
from flotilla.operator.controllers.webhook_reviews import review_service
from flotilla.operator.desired.validation import validate
from flotilla.operator.desired.workload import deployment, engine_args, engine_flags
from flotilla.operator.manifests.crds import crd

DRAFT = {"method": "draft", "model": {"uri": "file:///models/tiny-draft"}}


def _pod(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]


def _command(dep: dict) -> list[str]:
    (container,) = _pod(dep)["containers"]
    return container["command"]


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def _problems(spec: InferenceServiceSpec, exists: bool = True):
    return validate(spec, gpu_types={"h100"}, path_exists=lambda _path: exists)


# -- the API -------------------------------------------------------------------------------------------


def test_the_crd_schema_bounds_each_field():
    engine = crd(INFERENCE_SERVICE)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["engine"]["properties"]
    speculative = engine["speculative"]
    props = speculative["properties"]
    assert speculative["required"] == ["method"]
    assert props["method"]["enum"] == ["ngram", "draft"]
    assert (props["numSpeculativeTokens"]["minimum"], props["numSpeculativeTokens"]["maximum"]) == (1, 16)
    assert props["maxBatchSize"]["minimum"] == 1 and "maximum" not in props["maxBatchSize"]
    assert props["model"]["required"] == ["uri"]
    assert set(props["model"]["properties"]) == {"uri"}


@pytest.mark.parametrize(
    ("speculative", "field"),
    [
        ({}, "method"),
        ({"method": "none"}, "method"),  # leave speculative out instead
        ({"method": "medusa"}, "method"),
        ({"method": "ngram", "numSpeculativeTokens": 0}, "numSpeculativeTokens"),
        ({"method": "ngram", "numSpeculativeTokens": 17}, "numSpeculativeTokens"),
        ({"method": "ngram", "maxBatchSize": 0}, "maxBatchSize"),
        ({"method": "draft", "model": {}}, "model.uri"),
        ({"method": "draft", "model": {"uri": ""}}, "model.uri"),
        ({"method": "draft", "model": {"uri": "file:///d", "servedName": "d"}}, "model.servedName"),
        ({"method": "ngram", "k": 4}, "k"),
    ],
)
def test_pydantic_refuses_what_the_crd_refuses_naming_the_field(make_spec, speculative, field):
    with pytest.raises(ValidationError) as caught:
        make_spec(engine={"speculative": speculative})
    (error,) = caught.value.errors()
    assert ".".join(str(p) for p in error["loc"]) == f"engine.speculative.{field}"


def test_the_wire_format_is_camel_case(make_spec):
    wire = {"method": "ngram", "numSpeculativeTokens": 6, "maxBatchSize": 8}
    spec = make_spec(engine={"speculative": wire})
    assert spec.engine.speculative is not None and spec.engine.speculative.num_speculative_tokens == 6
    assert spec.to_wire()["engine"]["speculative"] == wire


# -- the flags -----------------------------------------------------------------------------------------


def test_no_speculative_keeps_the_engines_default(make_spec):
    assert not [f for f in engine_flags(make_spec().engine) if f.startswith("--speculative")]
    assert engine_args(make_spec().engine).speculative_method is None


def test_ngram_flags(make_spec):
    engine = make_spec(
        engine={"speculative": {"method": "ngram", "numSpeculativeTokens": 8, "maxBatchSize": 2}}
    )
    assert engine_flags(engine.engine) == [
        "--speculative-method", "ngram",
        "--num-speculative-tokens", "8",
        "--speculative-max-batch-size", "2",
    ]  # fmt: skip


def test_unset_counts_keep_the_engines_defaults(make_spec):
    assert engine_flags(make_spec(engine={"speculative": {"method": "ngram"}}).engine) == [
        "--speculative-method",
        "ngram",
    ]


def test_draft_gets_the_mounted_draft_path(owner, decision, config, make_spec):
    spec = make_spec(engine={"speculative": {**DRAFT, "numSpeculativeTokens": 3}})
    command = _command(deployment(owner, spec, decision, config))
    assert _flag(command, "--speculative-method") == "draft"
    assert _flag(command, "--speculative-model") == "/models/tiny-draft"
    assert _flag(command, "--num-speculative-tokens") == "3"
    assert _flag(command, "--model") == "/models/tiny-llama"
    # Without a pod (engine_flags), there is no path to name.
    assert "--speculative-model" not in engine_flags(spec.engine)


def test_ngram_mounts_nothing(owner, decision, config, make_spec):
    plain = _pod(deployment(owner, make_spec(), decision, config))
    pod = _pod(deployment(owner, make_spec(engine={"speculative": {"method": "ngram"}}), decision, config))
    assert (
        pod["volumes"] == plain["volumes"]
        and pod["containers"][0]["volumeMounts"] == plain["containers"][0]["volumeMounts"]
    )
    assert "--speculative-model" not in pod["containers"][0]["command"]


# -- the draft model's mount, for each scheme ----------------------------------------------------------

HF_CACHE = OperatorConfig(default_image="flotilla-engine:test", hf_cache_dir="/var/cache/hf")


@pytest.mark.parametrize(
    ("uri", "cfg", "volume", "mount_path", "path", "fetched"),
    [
        (
            "file:///models/tiny-draft",
            None,
            {"hostPath": {"path": "/models/tiny-draft", "type": "Directory"}},
            "/models/tiny-draft",
            "/models/tiny-draft",
            None,
        ),
        (
            "pvc://drafts/llama/1b",
            None,
            {"persistentVolumeClaim": {"claimName": "drafts", "readOnly": True}},
            "/mnt/draft-models/drafts",
            "/mnt/draft-models/drafts/llama/1b",
            None,
        ),
        (
            "hf://acme/tiny-draft",
            HF_CACHE,
            {"hostPath": {"path": "/var/cache/hf/acme/tiny-draft", "type": "Directory"}},
            "/var/cache/hf/acme/tiny-draft",
            "/var/cache/hf/acme/tiny-draft",
            None,
        ),
        (
            "hf://acme/tiny-draft@v2",
            None,
            {"emptyDir": {}},
            "/mnt/draft-models",
            "/mnt/draft-models/hf/acme/tiny-draft@v2",
            "hf://acme/tiny-draft@v2",
        ),
        (
            "https://models.example/draft.tar.gz",
            None,
            {"emptyDir": {}},
            "/mnt/draft-models",
            "/mnt/draft-models/download/model",
            "https://models.example/draft.tar.gz",
        ),
    ],
    ids=["file", "pvc", "hf-cache", "hf-fetched", "https"],
)
def test_the_draft_is_mounted_under_its_own_names(
    owner, decision, config, make_spec, uri, cfg, volume, mount_path, path, fetched
):
    spec = make_spec(engine={"speculative": {"method": "draft", "model": {"uri": uri}}})
    pod = _pod(deployment(owner, spec, decision, cfg or config))
    (container,) = pod["containers"]
    assert {"name": "draft-model", **volume} in pod["volumes"]
    assert {"name": "draft-model", "mountPath": mount_path, "readOnly": True} in container["volumeMounts"]
    assert _flag(container["command"], "--speculative-model") == path
    # The served model keeps its own volume, untouched.
    assert {"name": "model", "hostPath": {"path": "/models/tiny-llama", "type": "Directory"}} in pod[
        "volumes"
    ]
    inits = {init["name"]: init for init in pod.get("initContainers", [])}
    if fetched is None:
        assert inits == {}
    else:
        (init,) = inits.values()
        assert init["name"] == "fetch-draft-model"
        assert init["command"] == ["flotilla", "model", "fetch", fetched, "--dest", path]
        assert init["volumeMounts"] == [{"name": "draft-model", "mountPath": "/mnt/draft-models"}]
        assert init["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize(
    ("model", "draft"),
    [
        ("hf://acme/big", "hf://acme/small"),
        ("pvc://models/big", "pvc://models/small"),
        ("https://models.example/big.tar.gz", "https://models.example/small.tar.gz"),
    ],
)
def test_both_models_fetched_or_claimed_never_collide(owner, decision, config, make_spec, model, draft):
    spec = make_spec(
        model={"uri": model}, engine={"speculative": {"method": "draft", "model": {"uri": draft}}}
    )
    pod = _pod(deployment(owner, spec, decision, config))
    (container,) = pod["containers"]
    names = [v["name"] for v in pod["volumes"]]
    paths = [m["mountPath"] for m in container["volumeMounts"]]
    inits = [i["name"] for i in pod.get("initContainers", [])]
    assert len(set(names)) == len(names) and len(set(paths)) == len(paths) and len(set(inits)) == len(inits)
    assert {"model", "draft-model"} <= set(names)
    model_path = _flag(container["command"], "--model")
    draft_path = _flag(container["command"], "--speculative-model")
    assert model_path is not None and draft_path is not None
    assert model_path.startswith("/mnt/models/") and draft_path.startswith("/mnt/draft-models/")
    # Each init container fetches into the folder its model's flag names.
    dests = {i["name"]: i["command"][-1] for i in pod.get("initContainers", [])}
    assert dests in ({}, {"fetch-model": model_path, "fetch-draft-model": draft_path})


def test_a_draft_that_is_the_served_model_is_mounted_once(owner, decision, config, make_spec):
    same = {"method": "draft", "model": {"uri": "file:///models/tiny-llama/"}}
    pod = _pod(deployment(owner, make_spec(engine={"speculative": same}), decision, config))
    (container,) = pod["containers"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp", "model"]
    assert _flag(container["command"], "--speculative-model") == "/models/tiny-llama"


# -- refused combinations ------------------------------------------------------------------------------


def test_good_specs_have_no_problems(make_spec):
    for engine in (
        {"speculative": DRAFT},
        {"speculative": {"method": "ngram", "numSpeculativeTokens": 16, "maxBatchSize": 1}},
        {"quantization": "int4", "quantizationGroupSize": 32},
        {"quantization": "int8"},
    ):
        assert _problems(make_spec(engine=engine)) == [], engine


def test_draft_without_a_model_is_refused(make_spec):
    (p,) = _problems(make_spec(engine={"speculative": {"method": "draft"}}))
    assert (p.field, p.reason) == ("spec.engine.speculative.model", "InvalidSpeculative")
    assert "method 'draft' needs a draft model" in p.message


def test_ngram_with_a_model_is_refused_naming_the_uri(make_spec):
    spec = make_spec(engine={"speculative": {"method": "ngram", "model": {"uri": "hf://acme/d"}}})
    (p,) = _problems(spec)
    assert (p.field, p.reason) == ("spec.engine.speculative.model", "InvalidSpeculative")
    assert "method 'ngram' takes no draft model, got uri 'hf://acme/d'" in p.message


@pytest.mark.parametrize(("quantization", "shown"), [(None, "unset"), ("none", "'none'"), ("int8", "'int8'")])
def test_a_group_size_without_int4_is_refused(make_spec, quantization, shown):
    engine: dict = {"quantizationGroupSize": 64}
    if quantization is not None:
        engine["quantization"] = quantization
    (p,) = _problems(make_spec(engine=engine))
    assert (p.field, p.reason) == ("spec.engine.quantizationGroupSize", "InvalidQuantization")
    assert p.message.startswith(f"64 is set while quantization is {shown}; a group size applies to int4 only")


def test_a_draft_uri_we_cannot_mount_is_refused(make_spec):
    spec = make_spec(engine={"speculative": {"method": "draft", "model": {"uri": "s3://bucket/d"}}})
    (p,) = _problems(spec)
    assert (p.field, p.reason) == ("spec.engine.speculative.model.uri", "InvalidModelUri")
    assert "'s3'" in p.message


def test_a_missing_draft_path_is_refused_by_the_reconciler(make_spec):
    spec = make_spec(model={"uri": "hf://acme/big"}, engine={"speculative": DRAFT})
    (p,) = _problems(spec, exists=False)
    assert (p.field, p.reason) == ("spec.engine.speculative.model.uri", "ModelNotFound")
    assert "/models/tiny-draft does not exist" in p.message
    assert validate(spec, gpu_types=None, path_exists=None) == []


def test_the_webhook_refuses_each_combination_in_the_same_words():
    raw = {
        "model": {"uri": "file:///m"},
        "engine": {"quantizationGroupSize": 32, "speculative": {"method": "draft"}},
    }
    verdict, held = review_service(key=("a", "s"), new_raw=raw, old_raw=None, tenant=None, tenant_spec=None,
                                   others=[], host_path_roots=("/m",))  # fmt: skip
    assert not verdict.allowed and held is None and verdict.code == 422
    assert verdict.reason == "InvalidQuantization"
    assert verdict.message == (
        "spec.engine.quantizationGroupSize: 32 is set while quantization is unset; a group size applies to "
        "int4 only (set quantization: int4, or leave quantizationGroupSize out); "
        "spec.engine.speculative.model: method 'draft' needs a draft model: set model.uri to a smaller model "
        "with the same tokenizer (or use method: ngram, which needs none)"
    )
