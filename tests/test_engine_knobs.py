"""Each engine knob is declared once, in flotilla.contract.ENGINE_KNOBS, and every other place that names it
agrees: EngineConfig's fields and defaults, the flags of `flotilla engine serve`, the CRD's spec.engine, and
the argv the operator builds, which the engine's own parser reads back into those values."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Literal, get_args, get_origin

import pytest
from pydantic import BaseModel

from flotilla.cli import build_parser
from flotilla.contract import CRD_KNOBS, CRD_MODEL, CRD_QUANTITY, ENGINE_KNOBS, OPERATOR_KNOBS, EngineArgs
from flotilla.engine.config import EngineConfig
from flotilla.engine.engine_args import engine_config_from_args
from flotilla.operator.api.v1alpha1 import EngineSettings, InferenceServiceSpec
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.workload import Decision, Owner, deployment
from flotilla.quantity import quantity_bytes

NOT_KNOBS = {"show_progress"}  # EngineConfig fields no flag sets
# spec.engine fields that set no knob: extraArgs is appended; adapterDir and adapterClaim are volumes.
NOT_KNOB_FIELDS = {"extraArgs", "lora.adapterDir", "lora.adapterClaim"}

# Every CRD field set, each to a value other than the engine's default (a test below checks both).
EVERY_FIELD = {
    "maxNumSeqs": 8,
    "maxNumBatchedTokens": 512,
    "blockSize": 32,
    "kvCacheMemory": "2Gi",
    "prefixCaching": False,
    "dtype": "bfloat16",
    "schedulingPolicy": "fair",
    "quantization": "int4",
    "quantizationGroupSize": 64,
    "speculative": {
        "method": "draft",
        "numSpeculativeTokens": 3,
        "maxBatchSize": 2,
        "model": {"uri": "file:///models/tiny-draft"},
    },
    "lora": {
        "enabled": True,
        "maxLoras": 2,
        "maxLoraRank": 16,
        "maxCpuLoras": 3,
        "adapterDir": "/adapters",
        "adapterClaim": "adapters",
    },
    "extraArgs": ["--seed", "7"],
}
# Fields that may not be set together (the engine refuses adapters over a quantized base): the argv test
# runs once without each group, and the two runs together cover every field.
APART = ({"quantization", "quantizationGroupSize"}, {"lora"})
WEIGHTS = (("team-b", 0.5), ("team-c", 3.0))


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    for command in ("engine", "serve"):
        (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = commands.choices[command]
    return parser


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _crd_fields(model: type[BaseModel] = EngineSettings, prefix: str = "") -> dict[str, Any]:
    """spec.engine's fields by dotted camelCase path -> annotation, into nested objects but for those a knob
    takes whole (a model source)."""
    claimed = {knob.crd for knob in CRD_KNOBS.values()}
    fields: dict[str, Any] = {}
    for field in model.model_fields.values():
        path = f"{prefix}{field.alias}"
        nested = _model_of(field.annotation)
        if nested is None or path in claimed:
            fields[path] = field.annotation
        else:
            fields |= _crd_fields(nested, f"{path}.")
    return fields


def _at(wire: dict, path: str) -> Any:
    value: Any = wire
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _literal_values(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return tuple(v for arg in get_args(annotation) for v in _literal_values(arg))


# -- EngineConfig --------------------------------------------------------------------------------------------
def test_engine_configs_knob_fields_are_the_tables_knobs_with_its_defaults() -> None:
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert set(fields) - NOT_KNOBS == set(ENGINE_KNOBS)
    for name, knob in ENGINE_KNOBS.items():
        field = fields[name]
        if knob.required:
            assert field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING, name
            continue
        assert field.metadata.get("knob") == name, f"EngineConfig.{name} takes another knob's default"
        default = (
            field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        )
        assert default == knob.default and type(default) is type(knob.fresh_default()), name


def test_a_config_of_defaults_holds_the_tables_defaults() -> None:
    config = EngineConfig(model="m")
    for name, knob in ENGINE_KNOBS.items():
        if not knob.required:
            assert getattr(config, name) == knob.default, name


# -- the engine's flags --------------------------------------------------------------------------------------
@pytest.mark.parametrize("knob", ENGINE_KNOBS.values(), ids=ENGINE_KNOBS.keys())
def test_every_knob_is_a_flag_of_engine_serve_as_the_table_declares(knob) -> None:
    actions = _serve_parser()._option_string_actions
    assert knob.flag in actions, f"`flotilla engine serve` has no {knob.flag}"
    action = actions[knob.flag]
    assert action.dest == knob.dest and action.help == knob.help
    if knob.parse is None:
        assert action.nargs == 0 and action.default is False and action.const is True  # store_true
        return
    assert action.required == knob.required
    if not knob.required:
        assert action.default == knob.default
    assert tuple(action.choices or ()) == (knob.choices if knob.parser_checks else ())


def test_the_parsed_defaults_build_the_default_config() -> None:
    args = _serve_parser().parse_args(["--model", "m"])
    assert engine_config_from_args(args, show_progress=True) == EngineConfig(model="m")


# -- the CRD ---------------------------------------------------------------------------------------------------
def test_every_crd_field_of_spec_engine_is_a_knob_and_every_crd_knob_a_field() -> None:
    fields = set(_crd_fields()) - NOT_KNOB_FIELDS
    knobs = {knob.crd for knob in CRD_KNOBS.values()}
    assert fields - knobs == set(), "spec.engine fields no knob in flotilla.contract.ENGINE_KNOBS names"
    assert knobs - fields == set(), "knobs whose `crd` field spec.engine does not have"


def test_the_crds_choices_are_the_knobs() -> None:
    fields = _crd_fields()
    for knob in CRD_KNOBS.values():
        values = _literal_values(fields[knob.crd])
        if knob.choices and values:
            assert set(values) <= set(knob.choices), knob.crd


def test_the_operators_argv_for_every_crd_field_parses_back_to_those_values() -> None:
    # The spec sets every field, to a value that is not the engine's default (or the test proves nothing).
    full = InferenceServiceSpec.model_validate({"model": {"uri": "file:///m"}, "engine": EVERY_FIELD})
    assert not [path for path in _crd_fields() if _at(full.engine.to_wire(), path) is None], (
        "set it in EVERY_FIELD"
    )
    for left_out in APART:
        _check_argv({k: v for k, v in EVERY_FIELD.items() if k not in left_out})


def _check_argv(fields: dict) -> None:
    spec = InferenceServiceSpec.model_validate(
        {"model": {"uri": "file:///models/tiny-llama"}, "resources": {"gpus": 1}, "engine": fields}
    )
    wire = spec.engine.to_wire()
    for knob in CRD_KNOBS.values():
        assert _at(wire, knob.crd) != knob.default, knob.crd
    owner = Owner(name="chat", namespace="team-a", uid="uid-1")
    decision = Decision(tenant="team-a", replicas=1, tenant_weights=WEIGHTS)
    pod = deployment(owner, spec, decision, OperatorConfig(check_local_model_paths=False))["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    mounted = {m["mountPath"] for m in container.get("volumeMounts", [])}

    args = build_parser().parse_args(container["command"][1:])
    config = engine_config_from_args(args)
    for name, knob in CRD_KNOBS.items():
        value, got = _at(wire, knob.crd), getattr(config, name)
        if value is None:  # left out of this run: the engine's default
            assert got == knob.default, name
        elif knob.crd_value == CRD_QUANTITY:
            assert got == quantity_bytes(value), name
        elif knob.crd_value == CRD_MODEL:  # where the pod mounts the model the field names
            assert any(got == path or got.startswith(path.rstrip("/") + "/") for path in mounted), name
        else:
            assert got == value, name
    for name, knob in OPERATOR_KNOBS.items():
        if knob.from_tenants:
            assert getattr(config, name) == dict(WEIGHTS)
    assert config.seed == 7  # extraArgs


def test_engine_args_takes_only_the_knobs_the_operator_sets() -> None:
    assert set(OPERATOR_KNOBS) == {n for n, k in ENGINE_KNOBS.items() if k.crd or k.from_tenants}
    with pytest.raises(TypeError, match="seed"):
        EngineArgs(seed=1)
    args = EngineArgs(max_num_seqs=8, enable_prefix_caching=True)
    assert (args.max_num_seqs, args.block_size) == (8, None)
    assert args.flags() == ["--max-num-seqs", "8"]  # a switch's flag only for the value it sets
