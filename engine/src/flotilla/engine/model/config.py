"""A model folder's config.json as a ModelConfig; every error names the file and the field. No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flotilla.contract import FLAG_QUANTIZATION_GROUP_SIZE, QUANTIZATION_GROUP_SIZES
from flotilla.engine.model import hf_names

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded; the message names the file and, where one is at fault,
    the field."""


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None
    sliding_window: int | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"{path}: file not found (a model folder needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        def fail(name: str, why: str) -> ModelLoadError:
            return ModelLoadError(f"{source}: field {name!r}: {why}")

        def need(name: str, kind: type | tuple = int, default: Any = ...) -> Any:
            if name not in raw or raw[name] is None:
                if default is ...:
                    raise fail(name, "missing")
                return default
            value = raw[name]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise fail(name, f"expected {getattr(kind, '__name__', kind)}, got {value!r}")
            if kind in (int, float) and value <= 0:
                raise fail(name, f"must be positive, got {value!r}")
            return value

        archs = raw.get("architectures")
        if not isinstance(archs, list) or not archs:
            raise fail("architectures", f"missing; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise fail(
                "architectures", f"{arch} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise fail("hidden_act", f"only 'silu' is supported, got {hidden_act!r}")

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = need("num_key_value_heads", int, heads)
        if heads % kv_heads:
            raise fail("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads={heads}")
        head_dim = need("head_dim", int, None)
        if head_dim is None:
            if hidden % heads:
                raise fail("hidden_size", f"{hidden} is not divisible by num_attention_heads={heads}")
            head_dim = hidden // heads

        # transformers 5 writes `rope_parameters` (theta included); older versions `rope_scaling`.
        rope_field = "rope_parameters" if isinstance(raw.get("rope_parameters"), dict) else "rope_scaling"
        rope_scaling = raw.get(rope_field)
        rope_theta = need("rope_theta", float, 10000.0)
        if rope_field == "rope_parameters":
            theta = rope_scaling.get("rope_theta", rope_theta)
            if not isinstance(theta, int | float) or theta <= 0:
                raise fail("rope_parameters", f"'rope_theta' must be a positive number, got {theta!r}")
            rope_theta = float(theta)
        if rope_scaling is not None:
            if not isinstance(rope_scaling, dict):
                raise fail(rope_field, f"expected an object, got {rope_scaling!r}")
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind in (None, "default"):
                rope_scaling = None
            elif kind == "linear":
                if not isinstance(rope_scaling.get("factor"), int | float):
                    raise fail(rope_field, "linear scaling needs a numeric 'factor'")
            elif kind == "llama3":
                for key in (
                    "factor",
                    "low_freq_factor",
                    "high_freq_factor",
                    "original_max_position_embeddings",
                ):
                    if not isinstance(rope_scaling.get(key), int | float):
                        raise fail(rope_field, f"llama3 scaling needs a numeric {key!r}")
            else:
                raise fail(rope_field, f"type {kind!r} is not supported (supported: linear, llama3)")
            if rope_scaling is not None:
                rope_scaling = dict(rope_scaling, rope_type=kind)

        eos = raw.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        sliding = None
        if arch == "MistralForCausalLM" or (is_qwen2 and raw.get("use_sliding_window")):
            sliding = raw.get("sliding_window")
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=need("rms_norm_eps", float, 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=need("max_position_embeddings", int, 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 has biases on q, k and v only; Llama's attention_bias covers o_proj as well.
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sliding_window=sliding if isinstance(sliding, int) else None,
        )

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_size

    def decoder_linears(self) -> list[tuple[str, int, int]]:
        """(name, input features, output features) of each decoder layer's linear layers, as the engine
        names them (q/k/v and gate/up fused); every layer has the same ones, so layer 0 stands for all."""
        shapes = hf_names.serving_linear_shapes(self)
        return [(hf_names.layer_module(0, name), k, n) for name, (n, k) in shapes.items()]


def check_quantization(config: ModelConfig, method: str, group_size: int) -> None:
    """Refuses, before any weight is read, an int4 group size that does not divide a quantized layer's
    input features (each group of that many input features shares one scale)."""
    if method != "int4":
        return
    for name, in_features, _out in config.decoder_linears():
        if in_features % group_size:
            fits = [
                g for g in QUANTIZATION_GROUP_SIZES if all(k % g == 0 for _, k, _ in config.decoder_linears())
            ]
            hint = f"; {', '.join(map(str, fits))} would" if fits else "; no group size divides them all"
            raise ValueError(
                f"{FLAG_QUANTIZATION_GROUP_SIZE} {group_size} does not divide {name}'s {in_features} input "
                f"features (int4 shares one scale per group of that many input features{hint})"
            )
