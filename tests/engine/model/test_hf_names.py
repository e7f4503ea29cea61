"""Hugging Face's tensor names have one home, model/hf_names.py: the serving model's parameters and the
trainer's are exactly what its tables say, the loader's mapping covers every serving parameter, and no
other module spells a name (there were four tables once)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from flotilla.engine.model import hf_names
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.model.llama import LlamaForCausalLM
from flotilla.engine.model.synthetic.train import TrainingLlama

ROOT = Path(__file__).resolve().parents[3]
SOURCE_ROOTS = [ROOT / d / "src" for d in (".", "engine", "operator", "gateway", "bench")]
HOME = Path(hf_names.__file__).resolve()

SMALL = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 40,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
CONFIGS = {
    "llama": SMALL,
    "llama-all-biases": {**SMALL, "attention_bias": True, "mlp_bias": True, "head_dim": 8},
    "qwen2-tied": {**SMALL, "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
}


def _spellings() -> tuple[str, ...]:
    """What a copy of the names would contain: every module's own name and the body's prefixes."""
    modules = [
        hf_names.EMBED_TOKENS,
        hf_names.FINAL_NORM,
        hf_names.LM_HEAD,
        *hf_names.linear_shapes(ModelConfig.from_dict(SMALL)),
        *hf_names.FUSED,
        *hf_names.LAYER_NORMS,
    ]
    shorts = {hf_names.short(m) for m in modules} - {"norm"}  # a word of its own; model.norm below
    parents = {m.rpartition(".")[0] for m in modules} - {"", "mlp", hf_names.BODY}
    whole = {hf_names.FINAL_NORM, f"{hf_names.BODY}.{hf_names.LAYERS}", *hf_names.IGNORED_SUFFIXES}
    return tuple(sorted(shorts | parents | whole))


def _strings(path: Path):
    """The string constants of a module, f-strings' literal parts included, docstrings excluded (they
    may name what a module handles)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_the_spellings_cover_the_names() -> None:
    spelled = _spellings()
    some = {"self_attn", "q_proj", "gate_up_proj", "input_layernorm", "embed_tokens", "lm_head"}
    assert some <= set(spelled)
    assert "model.layers" in spelled and "model.norm" in spelled


def test_no_module_but_hf_names_spells_a_hugging_face_tensor_name() -> None:
    """The loader, quantize, ModelConfig, the synthetic presets and trainer, and the benchmarks take the
    names from hf_names; a second table (or one name typed again) fails here."""
    spelled = _spellings()
    copies = []
    for root in SOURCE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            if path.resolve() == HOME:
                continue
            copies += [
                f"{path.relative_to(ROOT)}:{line} {value!r}"
                for line, value in _strings(path)
                if any(s in value for s in spelled)
            ]
    assert not copies, "Hugging Face tensor names spelled outside model/hf_names.py:\n" + "\n".join(copies)


@pytest.mark.parametrize("raw", CONFIGS.values(), ids=list(CONFIGS))
def test_every_checkpoint_tensor_fills_a_serving_parameter_and_every_parameter_is_filled(raw) -> None:
    config = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions=32)
    params = {name: tuple(p.shape) for name, p in model.named_parameters()}  # a tied LM head is not listed
    checkpoint = hf_names.checkpoint_tensors(config)
    shards: dict[str, list[int]] = {}
    for name, shape in checkpoint.items():
        target, fused, shard = hf_names.serving_parameter(name)
        assert target in params, name
        if fused is None:
            assert params[target] == shape, name
        else:
            assert shard is not None and hf_names.shard_rows(config, fused)[shard] == shape[0], name
            assert params[target][1:] == shape[1:], name
            shards.setdefault(target, []).append(shape[0])
    assert all(sum(rows) == params[target][0] for target, rows in shards.items())
    assert {hf_names.serving_parameter(name)[0] for name in checkpoint} == set(params)


@pytest.mark.parametrize("raw", CONFIGS.values(), ids=list(CONFIGS))
def test_the_serving_linears_are_the_models(raw) -> None:
    config = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions=32)
    for name, k, n in config.decoder_linears():
        module = model.model.get_submodule(name)
        assert (module.in_features, module.out_features) == (k, n), name
    assert [hf_names.short(name) for name, _, _ in config.decoder_linears()] == [
        hf_names.short(m) for m in hf_names.SERVING_LINEARS
    ]


# The trainer builds Llamas without biases, tied or not.
TRAINED = {"llama": SMALL, "llama-tied": {**SMALL, "tie_word_embeddings": True}}


@pytest.mark.parametrize("raw", TRAINED.values(), ids=list(TRAINED))
def test_the_trainers_weights_are_the_checkpoint_tensors(raw) -> None:
    """The trainer's model is Hugging Face's unfused layout: its state_dict, less a tied LM head, is the
    checkpoint as hf_names lists it."""
    model = TrainingLlama(raw, max_positions=32)
    got = {name: tuple(t.shape) for name, t in model.hf_state_dict().items()}
    assert got == hf_names.checkpoint_tensors(ModelConfig.from_dict(raw))


def test_names() -> None:
    assert hf_names.checkpoint_module(3, hf_names.Q_PROJ) == "model.layers.3.self_attn.q_proj"
    assert hf_names.layer_module(0, hf_names.DOWN_PROJ) == "layers.0.mlp.down_proj"
    assert hf_names.serving_parameter("model.layers.1.mlp.up_proj.bias") == (
        "model.layers.1.mlp.gate_up_proj.bias",
        hf_names.GATE_UP_PROJ,
        1,
    )
    assert hf_names.serving_parameter("model.layers.1.self_attn.o_proj.weight") == (
        "model.layers.1.self_attn.o_proj.weight",
        None,
        None,
    )
    norms = [n for n in hf_names.checkpoint_tensors(ModelConfig.from_dict(SMALL)) if hf_names.is_norm(n)]
    assert norms == [
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
    ]
    assert not hf_names.is_norm("model.embed_tokens.weight")
    assert hf_names.is_residual_output("model.layers.0.mlp.down_proj.weight")
    assert not hf_names.is_residual_output("model.layers.0.mlp.down_proj.bias")
