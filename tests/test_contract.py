"""The engine<->operator contract holds: every command the operator can put in a pod parses with the
engine's own CLI parser, to the values the spec asked for, and both halves take names from one module."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from flotilla import contract
from flotilla.cli import build_parser
from flotilla.operator.api.v1alpha1 import InferenceServiceSpec
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.workload import Decision, Owner, deployment
from flotilla.quantity import quantity_bytes

MODEL_URIS = [
    "file:///models/tiny-llama",
    "pvc://models/llama/8b",
    "hf://org/name",
    "hf://org/name@v1.0",
    "https://models.example/tiny-llama.tar.gz",
    "http://models.example/tiny-llama.tar",
]
ENGINE_SETTINGS = [
    {},
    {"maxNumSeqs": 8},
    {"maxNumBatchedTokens": 512, "blockSize": 32},
    {"kvCacheMemory": "2Gi"},
    {"prefixCaching": False},
    {"prefixCaching": True},
    {"dtype": "bfloat16"},
    {"schedulingPolicy": "fair"},
    {"schedulingPolicy": "priority"},
    {"quantization": "int8"},
    {"quantization": "int4", "quantizationGroupSize": 64},
    {"quantization": "none"},
    {"speculative": {"method": "ngram", "numSpeculativeTokens": 8, "maxBatchSize": 2}},
    {"speculative": {"method": "draft", "model": {"uri": "file:///models/tiny-draft"}}},
    {
        "maxNumSeqs": 64,
        "maxNumBatchedTokens": 4096,
        "blockSize": 8,
        "kvCacheMemory": "512Mi",
        "prefixCaching": False,
        "dtype": "float32",
        "extraArgs": ["--seed", "7", "--max-queue", "16"],
    },
]
CONFIGS = [OperatorConfig(check_local_model_paths=False), OperatorConfig(hf_cache_dir="/var/cache/hf")]


def _built_pods() -> list[tuple[str, InferenceServiceSpec, dict]]:
    """(id, spec, pod spec) for every model URI scheme, engine setting and operator configuration."""
    built = []
    owner = Owner(name="chat", namespace="team-a", uid="uid-1")
    for uri, engine, config in itertools.product(MODEL_URIS, ENGINE_SETTINGS, CONFIGS):
        spec = InferenceServiceSpec.model_validate(
            {"model": {"uri": uri}, "resources": {"gpus": 1}, "replicas": 1, "engine": engine}
        )
        decision = Decision(tenant="team-a", replicas=1, tenant_weights=(("team-b", 0.5), ("team-c", 3.0)))
        dep = deployment(owner, spec, decision, config)
        pod = dep["spec"]["template"]["spec"]
        built.append((f"{uri}|{sorted(engine)}|{config.hf_cache_dir}", spec, pod))
    return built


def _pods() -> list:
    return [pytest.param(spec, pod, id=pid) for pid, spec, pod in _built_pods()]


@pytest.mark.parametrize(("spec", "pod"), _pods())
def test_every_engine_command_parses_with_the_engines_cli(spec: InferenceServiceSpec, pod: dict) -> None:
    (container,) = pod["containers"]
    command = container["command"]
    assert command[:3] == list(contract.ENGINE_SERVE)
    args = build_parser().parse_args(command[1:])  # argparse exits (fails the test) on any unknown flag
    assert args.group == "engine" and args.command == "serve"
    engine = spec.engine
    assert args.port == contract.ENGINE_PORT
    assert args.host == f"$({contract.ENV_POD_IP})"
    assert args.served_model_name == "chat"
    if engine.max_num_seqs is not None:
        assert args.max_num_seqs == engine.max_num_seqs
    if engine.max_num_batched_tokens is not None:
        assert args.max_num_batched_tokens == engine.max_num_batched_tokens
    if engine.block_size is not None:
        assert args.block_size == engine.block_size
    if engine.kv_cache_memory is not None:
        assert args.kv_cache_memory == quantity_bytes(engine.kv_cache_memory)
    assert args.no_prefix_caching is (engine.prefix_caching is False)
    if engine.dtype is not None:
        assert args.dtype == engine.dtype
    if engine.scheduling_policy is not None:
        assert args.scheduling_policy == engine.scheduling_policy
    from flotilla.engine.config import EngineConfig

    default = EngineConfig(model="")  # unset settings keep the engine's defaults
    assert args.quantization == (engine.quantization or default.quantization)
    assert args.quantization_group_size == (engine.quantization_group_size or default.quantization_group_size)
    speculative = engine.speculative
    assert args.speculative_method == (speculative.method if speculative else default.speculative_method)
    tokens = speculative.num_speculative_tokens if speculative else None
    assert args.num_speculative_tokens == (tokens or default.num_speculative_tokens)
    batch = speculative.max_batch_size if speculative else None
    assert args.speculative_max_batch_size == (batch or default.speculative_max_batch_size)
    # The tenants' fair-share weights reach fair engines only (others must not roll on a weight change).
    fair = engine.scheduling_policy == "fair"
    assert args.tenant_weights == ({"team-b": 0.5, "team-c": 3.0} if fair else {})
    if "--seed" in engine.extra_args:
        assert args.seed == 7 and args.max_queue == 16
    # The model path the engine reads is the one the volumes put there.
    mounted = {m["mountPath"] for m in container.get("volumeMounts", [])}
    assert any(args.model == p or args.model.startswith(p.rstrip("/") + "/") for p in mounted)
    if speculative is not None and speculative.method == "draft":
        draft = args.speculative_model
        assert any(draft == p or draft.startswith(p.rstrip("/") + "/") for p in mounted)
    else:
        assert args.speculative_model is None
    # The engine's own checks of the settings together (EngineConfig) pass too.
    from flotilla.engine.engine_args import engine_config_from_args

    engine_config_from_args(args)


@pytest.mark.parametrize(("spec", "pod"), _pods())
def test_every_init_container_command_parses_with_the_engines_cli(
    spec: InferenceServiceSpec, pod: dict
) -> None:
    (container,) = pod["containers"]
    for init in pod.get("initContainers", []):
        command = init["command"]
        assert command[:3] == list(contract.MODEL_FETCH)
        args = build_parser().parse_args(command[1:])
        assert args.group == "model" and args.command == "fetch"
        # It fetches what the spec names, into the folder the engine is then started on.
        assert args.uri.startswith(spec.model.uri.split("://")[0] + "://")
        assert spec.model.uri.endswith(args.uri.split("://")[1])
        engine_args = build_parser().parse_args(container["command"][1:])
        assert Path(args.dest) == Path(engine_args.model)


def test_the_specs_quantization_values_are_the_contracts() -> None:
    from typing import get_args

    from flotilla.operator.api.v1alpha1 import EngineSettings

    fields = EngineSettings.model_fields
    (methods, _none) = get_args(fields["quantization"].annotation)
    assert get_args(methods) == contract.QUANTIZATION_METHODS
    (sizes, _none) = get_args(fields["quantization_group_size"].annotation)
    assert get_args(sizes) == contract.QUANTIZATION_GROUP_SIZES


def test_the_specs_speculative_values_are_the_contracts() -> None:
    from typing import get_args

    from annotated_types import Ge, Le

    from flotilla.operator.api.v1alpha1 import Speculative

    fields = Speculative.model_fields
    # Every method but "none", which is spec.engine.speculative left out.
    assert ("none", *get_args(fields["method"].annotation)) == contract.SPECULATIVE_METHODS
    bounds = fields["num_speculative_tokens"].metadata
    assert Ge(1) in bounds and Le(contract.MAX_SPECULATIVE_TOKENS) in bounds


def test_schemes_that_need_a_download_get_an_init_container() -> None:
    fetched = {pid.split("|")[0] for pid, _, pod in _built_pods() if pod.get("initContainers")}
    assert fetched == {
        "hf://org/name",
        "hf://org/name@v1.0",
        "https://models.example/tiny-llama.tar.gz",
        "http://models.example/tiny-llama.tar",
    }


def test_the_engine_exports_every_metric_the_operator_reads() -> None:
    from prometheus_client import generate_latest

    from flotilla.engine.core.outputs import EngineStats
    from flotilla.engine.server.metrics import EngineMetrics
    from flotilla.operator.clients.engine_metrics import parse_engine_metrics

    metrics = EngineMetrics("tiny", lambda: EngineStats(num_waiting=3, prompt_tokens=11, generation_tokens=5))
    metrics.ttft.observe(0.02)
    sample = parse_engine_metrics(generate_latest(metrics.registry).decode())
    assert sample.waiting == 3
    assert (sample.prompt_tokens, sample.generation_tokens) == (11, 5)
    assert sample.ttft_buckets[-1] == (float("inf"), 1.0)
