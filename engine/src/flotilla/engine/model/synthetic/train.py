"""Trains a small Llama on the synthetic corpus (`corpus.py`) with plain torch, for the trained presets.

The training model is its own few lines of torch (no transformers at run time), with Hugging Face
Llama's parameter names and layout (separate q/k/v and gate/up projections, rotate-half RoPE, RMSNorm), so
the saved `model.safetensors` loads in the engine and in transformers alike. AdamW, linear warm-up then
cosine decay, a fixed number of steps, on random windows of the documents packed end to end
(`<s> document </s> <s> ...`). The loss printed is the mean cross-entropy per token, in nats.

Why not the serving model (llama.py's LlamaForCausalLM): its forward is a flat batch of tokens against the
paged KV cache (batch metadata; each layer stores its keys and values into the cache in place, then
attends through a backend whose Triton and C kernels have no backward), where training wants dense
causal attention over [batch, window] windows with autograd (`F.scaled_dot_product_attention`); and it
fuses q/k/v and gate/up, where this model keeps Hugging Face's layout, so that its state_dict is the
checkpoint written and its seeded initialisation draws tensor by tensor in that layout's order. Training
the fused model would change every trained preset's weights (a TRAINER_VERSION bump: every cached preset
trained again) and serve nothing faster. Shared instead: RMSNorm (llama.py), RoPE's cos/sin tables and
rotation (rope.py), and the tensor names (hf_names.py: which weights are norms and residual outputs, the
tied LM head); tests/engine/model/test_hf_names.py holds this model's state_dict to hf_names.checkpoint_tensors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.engine.model import hf_names
from flotilla.engine.model.llama import RMSNorm  # the engine's own: the same weights, the same math
from flotilla.engine.model.rope import cos_sin_tables, rotate


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    documents: int
    held_out_documents: int = 300
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_windows: int = 32
    threads: int = 2
    log_every: int = 25
    # Run the forward and backward matmuls in bfloat16 (weights, optimizer and evaluation stay float32),
    # where the CPU has bfloat16 instructions: 1.5x faster for the target preset on AVX512-BF16.
    bf16_autocast: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainSpec:
        return cls(**raw)


@dataclass
class TrainResult:
    steps: int
    seconds: float
    tokens_seen: int
    initial_held_out_loss: float
    train_loss: float
    held_out_loss: float
    step_losses: list[float] = field(default_factory=list)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, (cos, sin)), rotate(k, (cos, sin))
        if self.kv_heads != self.heads:
            # Query head h reads KV head h // (heads / kv_heads), as transformers' repeat_kv does.
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], head_dim: int) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(
            hidden, config["num_attention_heads"], config["num_key_value_heads"], head_dim
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, config["intermediate_size"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, config: dict[str, Any], head_dim: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(
            DecoderLayer(config, head_dim) for _ in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])


class TrainingLlama(nn.Module):
    """A Llama causal LM for training: `state_dict()` names are Hugging Face's (`model.layers.0.
    self_attn.q_proj.weight`, ...); with tied embeddings `lm_head` shares the embedding matrix."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: dict[str, Any], max_positions: int) -> None:
        super().__init__()
        self.config = config
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        self.model = Body(config, head_dim)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        if config["tie_word_embeddings"]:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = cos_sin_tables(head_dim, max_positions, config["rope_theta"], config.get("rope_scaling"))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """normal(0, std) for matrices, the residual outputs scaled by 1/sqrt(2 * layers) (GPT-2's rule)."""
        residual_std = std / math.sqrt(2 * len(self.model.layers))
        with torch.no_grad():
            for name, param in self.named_parameters():
                if hf_names.is_norm(name):
                    param.fill_(1.0)
                else:
                    scale = residual_std if hf_names.is_residual_output(name) else std
                    param.copy_(torch.randn(param.shape, generator=generator) * scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab]."""
        t = input_ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face's names (hf_names.checkpoint_tensors'), contiguous, without the
        tied LM head."""
        out = {name: t.detach().contiguous().clone() for name, t in self.state_dict().items()}
        if self.config["tie_word_embeddings"]:
            out.pop(hf_names.weight(hf_names.LM_HEAD), None)
        return out


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); elsewhere autocast is slower."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def pack(token_lists: Sequence[Sequence[int]], bos_id: int | None, eos_id: int) -> torch.Tensor:
    """Documents end to end, each as `<s> tokens </s>` (no `<s>` where the tokenizer has none)."""
    ids: list[int] = []
    for tokens in token_lists:
        if bos_id is not None:
            ids.append(bos_id)
        ids.extend(tokens)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, spec: TrainSpec) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    floor = spec.lr * spec.min_lr_ratio
    return floor + 0.5 * (spec.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def eval_loss(model: TrainingLlama, stream: torch.Tensor, seq_len: int, windows: int) -> float:
    """Mean loss over `windows` evenly spaced windows of the stream (the same windows every call)."""
    n = min(windows, max(1, (len(stream) - 1) // seq_len))
    starts = torch.linspace(0, len(stream) - seq_len - 1, n).long()
    total = 0.0
    model.eval()
    with torch.no_grad():
        for chunk in starts.split(8):
            batch = torch.stack([stream[s : s + seq_len + 1] for s in chunk.tolist()])
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            total += float(loss)
    model.train()
    return total / (n * seq_len)


def train(
    config: dict[str, Any],
    spec: TrainSpec,
    train_stream: torch.Tensor,
    held_out_stream: torch.Tensor,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> tuple[TrainingLlama, TrainResult]:
    """Trains a fresh model of `config` (a Hugging Face Llama config dict) for `spec.steps` steps on
    random windows of `train_stream`; returns it with its losses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        return _train(config, spec, train_stream, held_out_stream, seed, log)
    finally:
        torch.set_num_threads(threads)


def _train(config, spec, train_stream, held_out_stream, seed, log) -> tuple[TrainingLlama, TrainResult]:
    gen = torch.Generator().manual_seed(seed)
    model = TrainingLlama(config, max(spec.seq_len, config.get("max_position_embeddings", 0)))
    model.init_weights(gen)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
    )
    n_params = sum(p.numel() for p in model.parameters())
    bf16 = spec.bf16_autocast and cpu_has_bf16()
    initial = eval_loss(model, held_out_stream, spec.seq_len, spec.eval_windows)
    log(
        f"training {n_params / 1e6:.2f}M parameters for {spec.steps} steps of {spec.batch_size}x"
        f"{spec.seq_len} tokens on {spec.threads} threads{' (bfloat16 matmuls)' if bf16 else ''} "
        f"({len(train_stream):,} corpus tokens); held-out loss before training {initial:.3f}"
    )
    start = time.perf_counter()
    losses: list[float] = []
    high = len(train_stream) - spec.seq_len - 1
    for step in range(spec.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        starts = torch.randint(0, high, (spec.batch_size,), generator=gen).tolist()
        batch = torch.stack([train_stream[s : s + spec.seq_len + 1] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % spec.log_every == 0 or step + 1 == spec.steps:
            recent = losses[-spec.log_every :]
            log(
                f"step {step + 1}/{spec.steps}  loss {sum(recent) / len(recent):.3f}  "
                f"lr {lr_at(step, spec):.2e}  {time.perf_counter() - start:.0f}s"
            )
    seconds = time.perf_counter() - start
    train_loss = eval_loss(model, train_stream, spec.seq_len, spec.eval_windows)
    held_out = eval_loss(model, held_out_stream, spec.seq_len, spec.eval_windows)
    log(f"done in {seconds:.0f}s: train loss {train_loss:.3f}, held-out loss {held_out:.3f}")
    model.eval()
    result = TrainResult(
        steps=spec.steps,
        seconds=round(seconds, 1),
        tokens_seen=spec.steps * spec.batch_size * spec.seq_len,
        initial_held_out_loss=round(initial, 4),
        train_loss=round(train_loss, 4),
        held_out_loss=round(held_out, 4),
        step_losses=losses,
    )
    return model, result


def save_weights(model: TrainingLlama, folder: Path) -> int:
    """Writes model.safetensors (float32, Hugging Face names); returns the parameter count."""
    from flotilla.engine.model.synthetic.weights_file import save_weights_file

    tensors = model.hf_state_dict()
    save_weights_file(tensors, folder / "model.safetensors")
    return sum(t.numel() for t in tensors.values())
