"""Hugging Face Llama's tensor names, the one place they are spelled, and how the serving model's
parameters map to them. No torch.

A Llama-family checkpoint (Llama 2/3, Mistral, Qwen2) names its tensors `model.embed_tokens.weight`,
`model.norm.weight`, `lm_head.weight` (absent with tied embeddings) and, per decoder layer i,
`model.layers.{i}.<module>.weight` (and `.bias`) for the modules below. The serving model (llama.py) keeps
these names but fuses q/k/v into `self_attn.qkv_proj` and gate/up into `mlp.gate_up_proj`, each one
matmul; the loader concatenates the checkpoint's shards along the output rows (FUSED). The training model
(synthetic/train.py) keeps Hugging Face's unfused layout, so its state_dict is the checkpoint as written.

Who uses it: the loader (checkpoint -> serving parameters), quantize (the serving layers it replaces),
ModelConfig.decoder_linears, the synthetic presets and trainer (the names they write) and the benchmarks
(bench/engine/gpu_model.py, compute_limit.py). tests/engine/model/test_hf_names.py fails if another module
spells one of these names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flotilla.engine.model.config import ModelConfig

WEIGHT, BIAS = "weight", "bias"

# The causal LM's own modules: the decoder body and the LM head.
BODY = "model"
EMBED_TOKENS = f"{BODY}.embed_tokens"
FINAL_NORM = f"{BODY}.norm"
LM_HEAD = "lm_head"
LAYERS = "layers"  # the body's decoder layers (`model.layers.{i}` in the checkpoint)

# A decoder layer's modules, relative to the layer, in the checkpoint.
Q_PROJ = "self_attn.q_proj"
K_PROJ = "self_attn.k_proj"
V_PROJ = "self_attn.v_proj"
O_PROJ = "self_attn.o_proj"
GATE_PROJ = "mlp.gate_proj"
UP_PROJ = "mlp.up_proj"
DOWN_PROJ = "mlp.down_proj"
INPUT_NORM = "input_layernorm"
POST_ATTENTION_NORM = "post_attention_layernorm"
LAYER_NORMS = (INPUT_NORM, POST_ATTENTION_NORM)

# The serving model's fused modules -> the checkpoint modules they concatenate (output rows), in order.
QKV_PROJ = "self_attn.qkv_proj"
GATE_UP_PROJ = "mlp.gate_up_proj"
FUSED: dict[str, tuple[str, ...]] = {QKV_PROJ: (Q_PROJ, K_PROJ, V_PROJ), GATE_UP_PROJ: (GATE_PROJ, UP_PROJ)}
# The serving decoder layer's linear layers, in the order they run (what quantization replaces).
SERVING_LINEARS = (QKV_PROJ, O_PROJ, GATE_UP_PROJ, DOWN_PROJ)
# The residual branches' output projections (the trainer scales their initialisation down).
RESIDUAL_OUTPUTS = (O_PROJ, DOWN_PROJ)

# Checkpoint tensors that are not weights (older transformers saved RoPE's frequencies): skipped.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight(module: str) -> str:
    return f"{module}.{WEIGHT}"


def bias(module: str) -> str:
    return f"{module}.{BIAS}"


def layer_module(i: int, module: str) -> str:
    """Decoder layer i's module within the body: `layers.{i}.{module}` (the serving model's
    `model.model.get_submodule` path)."""
    return f"{LAYERS}.{i}.{module}"


def checkpoint_module(i: int, module: str) -> str:
    """Decoder layer i's module in the checkpoint (and in the causal LM): `model.layers.{i}.{module}`."""
    return f"{BODY}.{layer_module(i, module)}"


def short(module: str) -> str:
    """A module's own name, without its parent's: `qkv_proj` for `self_attn.qkv_proj`."""
    return module.rpartition(".")[2]


def is_norm(name: str) -> bool:
    """Whether a checkpoint tensor is an RMSNorm's weight (a layer's two norms or the final one)."""
    module = name.removesuffix(f".{WEIGHT}")
    return module == FINAL_NORM or module.endswith(tuple(f".{norm}" for norm in LAYER_NORMS))


def is_residual_output(name: str) -> bool:
    """Whether a checkpoint tensor is a residual branch's output projection weight (o_proj, down_proj)."""
    return name.endswith(tuple(f".{weight(module)}" for module in RESIDUAL_OUTPUTS))


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """A decoder layer's checkpoint linear modules -> (out_features, in_features)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {
        Q_PROJ: (q, hidden),
        K_PROJ: (kv, hidden),
        V_PROJ: (kv, hidden),
        O_PROJ: (hidden, q),
        GATE_PROJ: (inter, hidden),
        UP_PROJ: (inter, hidden),
        DOWN_PROJ: (hidden, inter),
    }


def serving_linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """The serving decoder layer's linear modules (SERVING_LINEARS, q/k/v and gate/up fused) ->
    (out_features, in_features)."""
    shapes = linear_shapes(config)
    out = {}
    for module in SERVING_LINEARS:
        parts = FUSED.get(module, (module,))
        out[module] = (sum(shapes[p][0] for p in parts), shapes[parts[0]][1])
    return out


def shard_rows(config: ModelConfig, fused: str) -> list[int]:
    """The output rows of each checkpoint shard of a fused serving module, in FUSED's order."""
    shapes = linear_shapes(config)
    return [shapes[part][0] for part in FUSED[fused]]


def checkpoint_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint of this config, by its Hugging Face name -> its shape, in a fixed
    order (the synthetic presets draw their random weights in it): the embeddings, the final norm, the LM
    head (untied only), then each layer's q, k, v, o weights, their biases, gate, up, down weights, their
    biases, and the two norms."""
    hidden, vocab = config.hidden_size, config.vocab_size
    out: dict[str, tuple[int, ...]] = {weight(EMBED_TOKENS): (vocab, hidden), weight(FINAL_NORM): (hidden,)}
    if not config.tie_word_embeddings:
        out[weight(LM_HEAD)] = (vocab, hidden)
    shapes = linear_shapes(config)
    attention, mlp = (Q_PROJ, K_PROJ, V_PROJ, O_PROJ), (GATE_PROJ, UP_PROJ, DOWN_PROJ)
    qkv_biases = (Q_PROJ, K_PROJ, V_PROJ) if config.qkv_bias else ()
    attention_biases = qkv_biases + ((O_PROJ,) if config.o_bias else ())
    mlp_biases = mlp if config.mlp_bias else ()
    for i in range(config.num_hidden_layers):
        out.update({weight(checkpoint_module(i, m)): shapes[m] for m in attention})
        out.update({bias(checkpoint_module(i, m)): shapes[m][:1] for m in attention_biases})
        out.update({weight(checkpoint_module(i, m)): shapes[m] for m in mlp})
        out.update({bias(checkpoint_module(i, m)): shapes[m][:1] for m in mlp_biases})
        out.update({weight(checkpoint_module(i, norm)): (hidden,) for norm in LAYER_NORMS})
    return out


def serving_parameter(name: str) -> tuple[str, str | None, int | None]:
    """A checkpoint tensor's name -> (the serving model's parameter it fills, the fused module or None,
    the shard's index in it or None). `model.layers.0.self_attn.k_proj.weight` ->
    (`model.layers.0.self_attn.qkv_proj.weight`, `self_attn.qkv_proj`, 1); unfused names map to
    themselves."""
    module, _, leaf = name.rpartition(".")
    for fused, parts in FUSED.items():
        for shard, part in enumerate(parts):
            if module.endswith(f".{part}"):
                return f"{module.removesuffix(part)}{fused}.{leaf}", fused, shard
    return name, None, None


# PEFT's LoRA adapters (adapter_model.safetensors) name each low-rank pair after the module it adapts, under
# PEFT's wrapper of the causal LM: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` is
# A ([rank, in_features]) and `...lora_B.weight` is B ([out_features, rank]); the update is B @ A scaled.
PEFT_PREFIX = "base_model.model."
LORA_A, LORA_B = "lora_A", "lora_B"
# The checkpoint modules an adapter may adapt (a decoder layer's linear layers), by their short names as
# PEFT's target_modules spells them.
LORA_TARGETS: dict[str, str] = {
    short(m): m for m in (Q_PROJ, K_PROJ, V_PROJ, O_PROJ, GATE_PROJ, UP_PROJ, DOWN_PROJ)
}


def peft_lora_tensor(name: str) -> tuple[int, str, str] | None:
    """A PEFT adapter tensor's name -> (layer, checkpoint module, LORA_A or LORA_B), or None where the
    name is not a LoRA weight of a decoder layer's module (the caller says what it is instead)."""
    rest = name.removeprefix(PEFT_PREFIX)
    prefix = f"{BODY}.{LAYERS}."
    if rest == name or not rest.startswith(prefix):
        return None
    layer, _, rest = rest.removeprefix(prefix).partition(".")
    module, _, leaf = rest.rpartition(".")  # leaf: weight
    module, _, which = module.rpartition(".")
    if (
        not layer.isdigit()
        or leaf != WEIGHT
        or which not in (LORA_A, LORA_B)
        or module not in LORA_TARGETS.values()
    ):
        return None
    return int(layer), module, which


def peft_lora_name(i: int, module: str, which: str) -> str:
    """peft_lora_tensor's inverse: the name PEFT saves layer i's module's A or B under."""
    return f"{PEFT_PREFIX}{checkpoint_module(i, module)}.{which}.{WEIGHT}"
