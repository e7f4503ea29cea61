"""Weight-only int8/int4 quantization (model/quantize.py): the math's error bounds, the quantized layers
against a float reference on the CPU (torch's weight-only kernels where they serve, dequantize-then-matmul
where they cannot), engines that load quantized and generate, their weight bytes against bfloat16, and the
settings refused at start-up with the setting, the value and the rule named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from flotilla.contract import FLAG_QUANTIZATION, FLAG_QUANTIZATION_GROUP_SIZE
from flotilla.engine.config import EngineConfig
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.llm_engine import LLMEngine
from flotilla.engine.model import quantize as qz
from flotilla.engine.model.config import ModelConfig, check_quantization

from ..conftest import write_byte_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[0, 5, 6, 7, 8], [0, *range(20, 60)], [0, 200, 100, 3]]


def _weights(n: int = 96, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm())


# -- the math -------------------------------------------------------------------------------------------------
def test_int8_round_trip_is_within_half_a_step_per_row():
    w = _weights()
    q, scale = qz.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (w.shape[0],)
    assert int(q.abs().max()) == 127  # each row's largest weight takes the top level
    error = (qz.dequantize_int8(q, scale) - w).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-6).all())
    assert _relative_error(qz.dequantize_int8(q, scale), w) < 0.01


@pytest.mark.parametrize("symmetric", [False, True], ids=["asymmetric", "symmetric"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_is_within_half_a_step_per_group(group, symmetric):
    w = _weights()
    q, scales, zeros = qz.quantize_int4(w, group, symmetric=symmetric)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and q.shape == w.shape
    assert scales.shape == (w.shape[0], w.shape[1] // group)
    assert (zeros is None) is symmetric
    back = qz.dequantize_int4(q, scales, zeros, group)
    step = scales.repeat_interleave(group, dim=1)
    assert bool(((back - w).abs() <= step / 2 + 1e-5).all())
    assert _relative_error(back, w) < 0.13  # 16 levels: about 7-11% on Gaussian weights


def test_all_zero_rows_and_groups_quantize_to_zeros():
    w = _weights(16, 64)
    w[3] = 0
    q8, s8 = qz.quantize_int8(w)
    assert bool((qz.dequantize_int8(q8, s8)[3] == 0).all())
    q4, s4, z4 = qz.quantize_int4(w, 32)
    back = qz.dequantize_int4(q4, s4, z4, 32)
    assert torch.isfinite(back).all() and float(back[3].abs().max()) < 1e-6


def test_int4_packs_two_values_per_byte_and_back():
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    packed = qz.pack_int4(q)
    assert packed.shape == (8, 32) and packed.dtype == torch.uint8
    assert torch.equal(qz.unpack_int4(packed), q)


def test_int4_refuses_a_group_that_does_not_divide_the_row():
    with pytest.raises(ValueError, match="group size 64 does not divide 96 input features"):
        qz.quantize_int4(_weights(16, 96), 64)


# -- the layers on the CPU ----------------------------------------------------------------------------------
def _linear(n: int, k: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(1)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_()
        if layer.bias is not None:
            layer.bias.normal_()
    return layer


def _input(k: int, rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_int8_layer_matches_the_float_layer(rows):
    layer = _linear(128, 256)
    x = _input(256, rows)
    quantized = qz.Int8Linear(layer, qz.kernel_dtype(torch.float32))
    assert quantized.kernel == "torch._weight_int8pack_mm"  # torch 2.x has it on CPU
    got = quantized(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 128)
    assert _relative_error(got, layer(x)) < 0.01
    # The kernel's only other difference from its own dequantized weights is bfloat16 rounding.
    assert (
        _relative_error(got, nn.functional.linear(x, quantized.dequantized(torch.float32), layer.bias)) < 0.01
    )


@pytest.mark.parametrize(("group", "bound"), [(32, 0.12), (64, 0.13), (128, 0.14)])
def test_int4_layer_matches_the_float_layer(group, bound):
    layer = _linear(128, 256)
    x = _input(256, 9)
    quantized = qz.Int4Linear(layer, qz.kernel_dtype(torch.float32), group)
    assert quantized.kernel == "torch._weight_int4pack_mm_for_cpu"
    error = _relative_error(quantized(x), layer(x))
    assert error < bound, f"int4 g{group}: {error:.3f}"
    # The kernel's only other difference from the same weights dequantized is bfloat16 rounding.
    q, _, _ = qz.quantize_int4(layer.weight.detach(), group)
    both = quantized.scales_and_zeros
    dequantized = qz.dequantize_int4(q, both[..., 0].T, both[..., 1].T, group)
    assert _relative_error(quantized(x), nn.functional.linear(x, dequantized, layer.bias)) < 0.01


def test_a_shape_the_int4_kernel_refuses_falls_back_to_dequantize():
    layer = _linear(24, 64)  # torch's CPU int4 packing wants out_features divisible by 16
    quantized = qz.Int4Linear(layer, torch.bfloat16, 32)
    assert quantized.kernel == qz.DEQUANTIZE
    x = _input(64)
    assert _relative_error(quantized(x), layer(x)) < 0.12


def test_a_missing_kernel_falls_back_to_dequantize(monkeypatch):
    monkeypatch.delattr(torch, "_weight_int8pack_mm")
    layer = _linear(32, 64, bias=False)
    quantized = qz.Int8Linear(layer, torch.bfloat16)
    assert quantized.kernel == qz.DEQUANTIZE
    x = _input(64)
    assert _relative_error(quantized(x), layer(x)) < 0.01


def test_a_kernel_that_disagrees_with_the_reference_is_not_used(monkeypatch):
    real = getattr(torch, "_weight_int8pack_mm")  # noqa: B009 (private: not in torch's exports)
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda x, w, s: -real(x, w, s), raising=True)
    quantized = qz.Int8Linear(_linear(32, 64), torch.bfloat16)
    assert quantized.kernel == qz.DEQUANTIZE


def test_building_a_layer_leaves_the_global_rng_alone():
    layer = _linear(32, 64)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    qz.Int4Linear(layer, torch.bfloat16, 32)
    assert torch.equal(torch.rand(3), expected)


# -- engines ------------------------------------------------------------------------------------------------
WIDE = {  # every linear layer's input features (128, 128, 128, 256) divisible by 128
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.2,
}


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """A random tiny Llama whose layers every int4 group size divides."""
    import transformers

    folder = tmp_path_factory.mktemp("wide-llama")
    vocab = write_byte_tokenizer(folder)
    config = transformers.LlamaConfig(**WIDE, vocab_size=vocab, bos_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().eval().save_pretrained(folder, safe_serialization=True)
    return folder


def _engine(folder: Path, quantization: str = "none", group: int = 128) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            device="cpu",
            dtype="float32",
            block_size=4,
            kv_cache_memory=1 << 22,
            show_progress=False,
            quantization=quantization,
            quantization_group_size=group,
        )
    )


def _greedy(engine: LLMEngine) -> list[list[int]]:
    return [r.token_ids or [] for r in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Greedy tokens equal position by position, up to each prompt's first difference."""
    same = 0
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=True):
            if s != t:
                break
            same += 1
    return same / sum(map(len, a))


@pytest.mark.parametrize(
    ("quantization", "group", "layer_ratio"),
    [("int8", 128, 0.55), ("int4", 128, 0.30), ("int4", 64, 0.30), ("int4", 32, 0.32)],
    ids=["int8", "int4-g128", "int4-g64", "int4-g32"],
)
def test_quantized_engines_generate_in_fewer_bytes(wide_model, quantization, group, layer_ratio):
    """Quantized layers take <= 0.55x (int8) and <= 0.30x (int4, g64/g128) of their bfloat16 bytes, scales
    included; int4 g32's scales and zeros (2 bfloat16 per 32 weights) put it at 0.3125x. Greedy agreement
    with the float model is reported, not asserted: the weights are random."""
    baseline = _engine(wide_model)
    engine = _engine(wide_model, quantization, group)
    info, model = engine.model_info, engine.runner.model
    assert (info.quantization, info.quantization_group_size) == (
        quantization,
        group if quantization == "int4" else None,
    )
    quantized = [m for m in model.modules() if isinstance(m, qz.QuantizedLinear)]
    assert len(quantized) == 4 * WIDE["num_hidden_layers"]
    assert {m.kernel for m in quantized} <= {"torch._weight_int8pack_mm", "torch._weight_int4pack_mm_for_cpu"}
    assert info.kernels == {quantized[0].kernel: len(quantized)}
    # Embeddings, norms and the LM head stay float.
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    layers = qz.quantized_weight_bytes(model) / qz.bf16_weight_bytes(model, quantized_only=True)
    assert layers <= layer_ratio
    # The float model's weights are float32 here; in bfloat16 terms the whole model shrinks too.
    assert info.bf16_weight_bytes == baseline.model_info.bf16_weight_bytes
    assert info.weight_bytes < baseline.model_info.weight_bytes
    whole = info.weight_bytes / info.bf16_weight_bytes
    tokens = _greedy(engine)
    assert all(len(t) == GREEDY.max_tokens for t in tokens)
    agreement = _agreement(tokens, _greedy(baseline))
    print(f"{quantization} g{group}: quantized layers {layers:.3f}x of bf16, whole model {whole:.3f}x, "
          f"greedy agreement with float {agreement:.2f}")  # fmt: skip


def test_int8_and_int4_engines_generate_on_the_tiny_test_model(hf_models):
    folder, _ = hf_models("qwen2-bias-tied")  # q/k/v biases and tied embeddings (the LM head stays float)
    for quantization, group in (("int8", 128), ("int4", 32)):
        engine = _engine(folder, quantization, group)
        assert engine.runner.model.lm_head.weight is engine.runner.model.model.embed_tokens.weight
        assert all(len(t) == GREEDY.max_tokens for t in _greedy(engine))


# -- settings refused at start-up ------------------------------------------------------------------------------
def test_unknown_method_and_group_size_are_refused_naming_the_rule():
    with pytest.raises(ValueError, match=f"^{FLAG_QUANTIZATION} int3: must be one of none, int8, int4$"):
        EngineConfig(model="m", quantization="int3")
    with pytest.raises(ValueError, match=f"^{FLAG_QUANTIZATION_GROUP_SIZE} 96: must be one of 32, 64, 128$"):
        EngineConfig(model="m", quantization="int4", quantization_group_size=96)


def test_the_cli_refuses_them_too(capsys):
    from flotilla.cli import build_parser

    for flag, value in ((FLAG_QUANTIZATION, "int3"), (FLAG_QUANTIZATION_GROUP_SIZE, "96")):
        for command in (["engine", "serve"], ["engine", "bench", "offline"]):
            with pytest.raises(SystemExit):
                build_parser().parse_args([*command, "--model", "m", flag, value])
            err = capsys.readouterr().err
            assert f"argument {flag}: invalid choice: " in err and value in err and "choose from" in err


def test_a_group_size_that_does_not_divide_a_layer_is_refused_before_loading(hf_models):
    folder, _ = hf_models("llama-gqa")  # intermediate_size 96
    config = ModelConfig.from_file(folder / "config.json")
    check_quantization(config, "int4", 32)
    check_quantization(config, "int8", 128)  # int8 has no groups
    rule = (
        f"{FLAG_QUANTIZATION_GROUP_SIZE} 128 does not divide layers.0.self_attn.qkv_proj's 64 input features"
    )
    with pytest.raises(ValueError, match=rule):
        check_quantization(config, "int4", 128)
    with pytest.raises(
        ValueError, match="does not divide layers.0.mlp.down_proj's 96 input features.*32 would"
    ):
        _engine(folder, "int4", 64)


def test_serve_refuses_before_listening(hf_models, capsys):
    from flotilla.cli import main

    folder, _ = hf_models("llama-gqa")
    argv = [
        "engine",
        "serve",
        "--model",
        str(folder),
        FLAG_QUANTIZATION,
        "int4",
        FLAG_QUANTIZATION_GROUP_SIZE,
        "64",
    ]
    assert main(argv) == 2
    assert "does not divide layers.0.mlp.down_proj's 96 input features" in capsys.readouterr().err


# -- reported ----------------------------------------------------------------------------------------------
def test_metrics_say_the_quantization_and_the_weight_bytes(hf_models):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from flotilla import contract
    from flotilla.engine.core.outputs import EngineStats
    from flotilla.engine.server.metrics import EngineMetrics

    folder, _ = hf_models("llama-gqa")
    engine = _engine(folder, "int4", 32)
    loaded = None
    metrics = EngineMetrics("tiny", lambda: EngineStats(), model_info=lambda: loaded)

    def families():
        text = generate_latest(metrics.registry).decode()
        return {f.name: f for f in text_string_to_metric_families(text)}

    before = families()  # loading: the families exist, without samples
    assert before[contract.MODEL_WEIGHT_BYTES].samples == [] and before[contract.MODEL_INFO].samples == []
    loaded = engine.model_info
    after = families()
    (weights,) = after[contract.MODEL_WEIGHT_BYTES].samples
    assert weights.value == engine.model_info.weight_bytes > 0
    (info,) = after[contract.MODEL_INFO].samples
    assert info.value == 1 and info.labels[contract.LABEL_MODEL] == "tiny"
    assert info.labels[contract.LABEL_QUANTIZATION] == "int4"
    assert info.labels[contract.LABEL_QUANTIZATION_GROUP_SIZE] == "32"
    assert info.labels[contract.LABEL_DTYPE] == "float32"


def test_bench_offline_reports_the_quantization(hf_models, tmp_path, capsys):
    from flotilla.cli import main

    folder, _ = hf_models("llama-gqa")
    out = tmp_path / "bench.json"
    args = ["engine", "bench", "offline", "--model", str(folder), "--num-prompts", "2", "--input-len", "4:8",
            "--output-len", "2:4", "--max-num-seqs", "2", "--prefix-requests", "0", "--budget-sequences", "2",
            "--block-size", "4", "--kv-cache-memory", str(1 << 20), "--threads", "1", "--no-profile",
            FLAG_QUANTIZATION, "int8", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["quantization"] == "int8" and report["quantization_group_size"] is None
    assert report["weight_bytes"] > 0 and report["quantized_layers_bf16_ratio"] <= 0.55
    assert report["quantized_layer_kernels"] == {"torch._weight_int8pack_mm": 8}
    assert "compute_limit" in report
    assert "weights: int8" in capsys.readouterr().out
