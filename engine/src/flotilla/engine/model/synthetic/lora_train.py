"""Trains a LoRA adapter over a trained preset with plain torch, and writes it as PEFT does.

The base is train.py's TrainingLlama with the preset's weights, frozen; each targeted linear layer of every
decoder layer is wrapped (`LoRALinear`) to add `B @ A` scaled by `lora_alpha / r`, PEFT's update: A starts
as PEFT initialises it (kaiming-uniform, here from the seeded generator) and B at zero, so training starts
from the base model exactly. Only A and B learn (AdamW, train.py's warm-up and cosine schedule, random
windows of the documents packed end to end). The folder written is a PEFT LoRA folder
(`adapter_config.json`, `adapter_model.safetensors` under PEFT's tensor names, hf_names.peft_lora_name), so
the engine, PEFT and vLLM load it alike.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.engine.model import hf_names
from flotilla.engine.model.synthetic import train


@dataclass(frozen=True)
class LoRAShape:
    """What the adapter adapts: PEFT's `r`, `lora_alpha` and target modules (checkpoint modules, such as
    hf_names.Q_PROJ), in every decoder layer."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LoRAShape:
        return cls(rank=int(raw["rank"]), alpha=float(raw["alpha"]), targets=tuple(raw["targets"]))


@dataclass
class LoRAResult:
    steps: int
    seconds: float
    base_held_out_loss: float  # the base model's loss on the held-out documents (the adapter at zero)
    held_out_loss: float  # with the trained adapter
    train_loss: float


class LoRALinear(nn.Module):
    """A frozen linear layer plus PEFT's low-rank update: `base(x) + (x @ A.T @ B.T) * alpha / r`."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        out_features, in_features = base.weight.shape
        # PEFT's init: kaiming_uniform_(a=sqrt(5)) on A, whose bound is 1/sqrt(in_features); B zero.
        bound = 1.0 / math.sqrt(in_features)
        self.lora_A = nn.Parameter((torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound)
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scale


def load_base(folder: Path, max_positions: int) -> train.TrainingLlama:
    """A trained preset's folder as a TrainingLlama (its config.json, its model.safetensors), frozen."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    model = train.TrainingLlama(config, max_positions)
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    tied = [hf_names.weight(hf_names.LM_HEAD)] if config["tie_word_embeddings"] else []
    if unexpected or sorted(missing) != tied:
        raise ValueError(
            f"{folder}: not a trained preset's weights (missing {missing}, unexpected {unexpected})"
        )
    model.requires_grad_(False)
    return model


def attach(model: train.TrainingLlama, shape: LoRAShape, generator: torch.Generator) -> dict:
    """Wraps each target of each decoder layer; returns (layer, module) -> its LoRALinear, in the order A was
    drawn (layers, then shape.targets), so a seed always gives the same initialisation."""
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for i, layer in enumerate(model.model.layers):
        for module in shape.targets:
            parent_name, _, attr = module.partition(".")
            parent = getattr(layer, parent_name)
            lora = LoRALinear(getattr(parent, attr), shape.rank, shape.alpha, generator)
            setattr(parent, attr, lora)
            wrapped[(i, module)] = lora
    return wrapped


def train_lora(
    base_folder: Path,
    shape: LoRAShape,
    spec: train.TrainSpec,
    train_stream: torch.Tensor,
    held_out_stream: torch.Tensor,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> tuple[dict, LoRAResult]:
    """Trains an adapter of `shape` over the preset in `base_folder` for `spec.steps` steps; returns its
    (layer, module) -> LoRALinear and the losses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        return _train(base_folder, shape, spec, train_stream, held_out_stream, seed, log)
    finally:
        torch.set_num_threads(threads)


def _train(base_folder, shape, spec, train_stream, held_out_stream, seed, log) -> tuple[dict, LoRAResult]:
    gen = torch.Generator().manual_seed(seed)
    model = load_base(base_folder, spec.seq_len)
    before = train.eval_loss(model, held_out_stream, spec.seq_len, spec.eval_windows)
    wrapped = attach(model, shape, gen)
    params = [p for lora in wrapped.values() for p in (lora.lora_A, lora.lora_B)]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay)
    n_params = sum(p.numel() for p in params)
    log(
        f"training a rank-{shape.rank} LoRA ({n_params:,} parameters on "
        f"{', '.join(hf_names.short(t) for t in shape.targets)}) for {spec.steps} steps of "
        f"{spec.batch_size}x{spec.seq_len} tokens on {spec.threads} threads; the base's held-out loss "
        f"on this text {before:.3f}"
    )
    start = time.perf_counter()
    losses: list[float] = []
    high = len(train_stream) - spec.seq_len - 1
    model.train()
    for step in range(spec.steps):
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(step, spec)
        starts = torch.randint(0, high, (spec.batch_size,), generator=gen).tolist()
        batch = torch.stack([train_stream[s : s + spec.seq_len + 1] for s in starts])
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % spec.log_every == 0 or step + 1 == spec.steps:
            recent = losses[-spec.log_every :]
            log(
                f"step {step + 1}/{spec.steps}  loss {sum(recent) / len(recent):.3f}  "
                f"{time.perf_counter() - start:.0f}s"
            )
    seconds = time.perf_counter() - start
    after = train.eval_loss(model, held_out_stream, spec.seq_len, spec.eval_windows)
    train_loss = train.eval_loss(model, train_stream, spec.seq_len, spec.eval_windows)
    log(f"done in {seconds:.0f}s: held-out loss {after:.3f} (the base: {before:.3f})")
    result = LoRAResult(
        steps=spec.steps,
        seconds=round(seconds, 1),
        base_held_out_loss=round(before, 4),
        held_out_loss=round(after, 4),
        train_loss=round(train_loss, 4),
    )
    return wrapped, result


def save_adapter(wrapped: dict, shape: LoRAShape, folder: Path, base_name: str) -> int:
    """Writes the PEFT folder: adapter_model.safetensors (float32, PEFT's names) and adapter_config.json;
    returns the parameter count."""
    from flotilla.engine.model.synthetic.weights_file import save_weights_file

    tensors = {}
    for (i, module), lora in sorted(wrapped.items()):
        tensors[hf_names.peft_lora_name(i, module, hf_names.LORA_A)] = (
            lora.lora_A.detach().contiguous().clone()
        )
        tensors[hf_names.peft_lora_name(i, module, hf_names.LORA_B)] = (
            lora.lora_B.detach().contiguous().clone()
        )
    save_weights_file(tensors, folder / "adapter_model.safetensors")
    config = peft_config(shape, base_name)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sum(t.numel() for t in tensors.values())


def peft_config(shape: LoRAShape, base_name: str, modules: Sequence[str] | None = None) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for a plain LoRA (no DoRA, no bias, no rsLoRA)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": shape.rank,
        "lora_alpha": shape.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(hf_names.short(m) for m in (modules or shape.targets)),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
