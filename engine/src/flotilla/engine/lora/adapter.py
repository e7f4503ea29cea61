"""A PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors), read and checked against the
base model, into the packed host form the device slots copy from.

PEFT adds, to each adapted linear layer, `B @ A` scaled by `lora_alpha / r` (rsLoRA: `lora_alpha / sqrt(r)`),
with A of shape [r, in_features] and B of shape [out_features, r]. The serving model fuses q/k/v and
gate/up (hf_names.FUSED), so an adapter's updates of one fused layer are packed side by side: A's rows of
q, then k, then v, stacked into one [width, in] matrix, and B's columns placed at the output rows of their
own shard in one [width, out] matrix (transposed, scale folded in). One pair of matmuls then adds all of
them, and a shard the adapter leaves alone costs no width.

Every refusal is a LoRAError naming the field or file, the value, and the limit or what was expected; a
refused adapter leaves nothing behind (nothing is registered before the whole folder has been checked).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flotilla.engine.lora.errors import LoRAError
from flotilla.engine.model import hf_names
from flotilla.engine.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT options that change what the update is, which this engine does not compute: refused by name.
_UNSUPPORTED_SWITCHES = {
    "use_dora": "DoRA",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D layout)",
    "lora_bias": "a bias on lora_B",
    "layer_replication": "layer replication",
}


@dataclass
class PackedUpdate:
    """One fused serving layer's update for one adapter: a [width, in] and bt [width, out] (scale folded
    in), width the sum of the ranks of the shards it adapts."""

    a: torch.Tensor
    bt: torch.Tensor

    @property
    def width(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the highest rank among its modules
    target_modules: tuple[str, ...]  # checkpoint modules' short names, e.g. ("q_proj", "v_proj")
    # (layer, serving module such as hf_names.QKV_PROJ) -> its packed update
    updates: dict[tuple[int, str], PackedUpdate] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(u.a.nbytes + u.bt.nbytes for u in self.updates.values())


def load_adapter(name: str, path: str, base: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"lora_path {path!r}: no such folder")
    config = _read_config(folder)
    weights = _read_weights(folder)
    pairs = _pairs(weights, base, folder)
    rsl = bool(config.get("use_rslora"))
    alpha = config.get("lora_alpha", config.get("r", 8))
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoRAError(
            f"{folder / CONFIG_FILE}: lora_alpha {alpha!r} must be a positive number", "lora_alpha"
        )
    _check_targets(config, folder)
    shapes = hf_names.linear_shapes(base)
    rank = 0
    scaled: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), (a, b) in sorted(pairs.items()):
        out_f, in_f = shapes[module]
        r = a.shape[0]
        a_name, b_name = (
            hf_names.peft_lora_name(layer, module, w) for w in (hf_names.LORA_A, hf_names.LORA_B)
        )
        if a.dim() != 2 or a.shape[1] != in_f:
            raise LoRAError(
                f"{a_name}: shape {list(a.shape)}, but the base model's {hf_names.short(module)} takes "
                f"{in_f} input features (hidden_size {base.hidden_size}): an adapter for another model?"
            )
        if b.dim() != 2 or list(b.shape) != [out_f, r]:
            raise LoRAError(
                f"{b_name}: shape {list(b.shape)}, expected [{out_f}, {r}] (the base model's "
                f"{hf_names.short(module)} has {out_f} output features; A has rank {r})"
            )
        if r > max_rank:
            raise LoRAError(f"{a_name}: rank {r} is above --max-lora-rank ({max_rank})", "r")
        rank = max(rank, r)
        scale = alpha / math.sqrt(r) if rsl else alpha / r
        scaled[(layer, module)] = (a.to(torch.float32), b.to(torch.float32) * scale)
    return LoRAAdapter(
        name=name,
        path=str(folder),
        rank=rank,
        target_modules=tuple(sorted({hf_names.short(m) for _l, m in scaled})),
        updates=_pack(scaled, base, dtype),
    )


def _read_config(folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoRAError(f"lora_path {str(folder)!r}: no {CONFIG_FILE} (a PEFT adapter folder has one)")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise LoRAError(f"{file}: must be a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRAError(f"{file}: peft_type {kind!r}; only LORA adapters are served", "peft_type")
    for key, what in _UNSUPPORTED_SWITCHES.items():
        if config.get(key):
            raise LoRAError(f"{file}: {key} is set; {what} is not supported", key)
    if config.get("bias", "none") not in ("none", None):
        raise LoRAError(
            f"{file}: bias {config['bias']!r}; only adapters without biases (none) are served", "bias"
        )
    for key in ("modules_to_save", "alpha_pattern"):
        if config.get(key):
            raise LoRAError(f"{file}: {key} {config[key]!r} is not supported (it must be empty)", key)
    return config


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = folder / WEIGHTS_FILE
    if not file.is_file():
        other = (
            " (only safetensors are read, not adapter_model.bin)"
            if (folder / "adapter_model.bin").exists()
            else ""
        )
        raise LoRAError(f"lora_path {str(folder)!r}: no {WEIGHTS_FILE}{other}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LoRAError(f"{file}: not a readable safetensors file ({exc})") from exc


def _pairs(
    weights: dict[str, torch.Tensor], base: ModelConfig, folder: Path
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in weights.items():
        parsed = hf_names.peft_lora_tensor(name)
        if parsed is None:
            raise LoRAError(
                f"{folder / WEIGHTS_FILE}: tensor {name!r} is not a LoRA weight of a decoder layer's "
                f"{', '.join(hf_names.LORA_TARGETS)} (the modules this engine adapts)",
                "target_modules",
            )
        layer, module, which = parsed
        if layer >= base.num_hidden_layers:
            raise LoRAError(
                f"{folder / WEIGHTS_FILE}: tensor {name!r} adapts layer {layer}; the base model has "
                f"{base.num_hidden_layers} layers"
            )
        halves.setdefault((layer, module), {})[which] = tensor
    if not halves:
        raise LoRAError(f"{folder / WEIGHTS_FILE}: holds no LoRA weights")
    pairs = {}
    for (layer, module), half in halves.items():
        missing = [w for w in (hf_names.LORA_A, hf_names.LORA_B) if w not in half]
        if missing:
            raise LoRAError(
                f"{folder / WEIGHTS_FILE}: no {hf_names.peft_lora_name(layer, module, missing[0])}"
            )
        pairs[(layer, module)] = (half[hf_names.LORA_A], half[hf_names.LORA_B])
    return pairs


def _check_targets(config: dict, folder: Path) -> None:
    """target_modules as a list must name modules the model has (a regex string is PEFT's own matching:
    the tensors, checked in _pairs, say what it matched)."""
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in hf_names.LORA_TARGETS]
        if unknown:
            raise LoRAError(
                f"{folder / CONFIG_FILE}: target_modules {unknown[0]!r}: the model has no such module (a "
                f"Llama, Mistral or Qwen2 decoder layer has {', '.join(hf_names.LORA_TARGETS)})",
                "target_modules",
            )


def _pack(
    scaled: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], base: ModelConfig, dtype: torch.dtype
) -> dict[tuple[int, str], PackedUpdate]:
    serving_shapes = hf_names.serving_linear_shapes(base)
    layers = sorted({layer for layer, _m in scaled})
    packed: dict[tuple[int, str], PackedUpdate] = {}
    for layer in layers:
        for serving in hf_names.SERVING_LINEARS:
            out_f = serving_shapes[serving][0]
            shards = hf_names.FUSED.get(serving, (serving,))
            rows = hf_names.shard_rows(base, serving) if serving in hf_names.FUSED else [out_f]
            a_parts, bt_parts, row = [], [], 0
            for shard, shard_rows in zip(shards, rows, strict=True):
                pair = scaled.get((layer, shard))
                if pair is not None:
                    a, b = pair
                    bt = torch.zeros(a.shape[0], out_f)
                    bt[:, row : row + shard_rows] = b.T
                    a_parts.append(a)
                    bt_parts.append(bt)
                row += shard_rows
            if a_parts:
                packed[(layer, serving)] = PackedUpdate(
                    torch.cat(a_parts).to(dtype).contiguous(), torch.cat(bt_parts).to(dtype).contiguous()
                )
    return packed
