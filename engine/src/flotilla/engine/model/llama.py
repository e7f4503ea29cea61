"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat batch of tokens with paged KV: the
serving model.

Module and parameter names follow Hugging Face's (hf_names.py spells them), except that q/k/v and gate/up
projections are fused into one matmul each (the loader concatenates the checkpoint's shards;
hf_names.FUSED).

The synthetic presets' trainer (synthetic/train.py) keeps a Llama of its own, on purpose: this one runs a
flat batch of tokens against the paged KV cache (batch metadata; every layer stores its keys and values
into the cache in place, then attends through a backend whose Triton and C kernels have no backward),
and fuses q/k/v and gate/up; training wants dense causal attention over [batch, window] with autograd,
and Hugging Face's unfused layout, whose state_dict is the checkpoint it writes. What both need is shared:
RMSNorm (here), RoPE's tables and rotation (rope.py) and the tensor names (hf_names.py);
tests/engine/model/test_hf_names.py holds both models' parameters to hf_names' tables.
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.engine.kernels import fused
from flotilla.engine.kernels.attention import ATTENTION_LABEL, AttentionMetadata
from flotilla.engine.kernels.linear import Linear
from flotilla.engine.kernels.profiling import profiler_range
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.model.rope import RotaryEmbedding, Rotation, rotate


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in float32 like transformers, then scaled in the model dtype (kernels/fused.py).
        return fused.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of x + residual, x + residual), in one pass where it can."""
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)

    def forward(self, rotation: Rotation, hidden, kv_cache, meta: AttentionMetadata, backend) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        k_cache, v_cache = kv_cache
        # Store before attending: a chunk attends to itself through the cache, and requests admitted
        # in the same step may share blocks written now.
        with profiler_range(ATTENTION_LABEL):
            q = backend.rotate_and_store(
                qkv, rotation, k_cache, v_cache, meta, self.num_heads, self.num_kv_heads
            )
            if q is None:  # the backend does not fuse them
                # Queries and keys are adjacent in qkv: rotate them as one [T, H + KVH, D] view.
                qk = rotate(
                    qkv[:, : self.q_size + self.kv_size].view(
                        -1, self.num_heads + self.num_kv_heads, self.head_dim
                    ),
                    rotation,
                )
                q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
                v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
                backend.store(k, v, k_cache, v_cache, meta)
            out = backend.attend(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=config.mlp_bias)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, rotation: Rotation, hidden, residual, kv_cache, meta, backend):
        """(this layer's MLP output, the residual stream before adding it): each residual add is fused
        with the norm that follows it (the next layer's, or the model's final norm)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add(hidden, residual)
        hidden = self.self_attn(rotation, hidden, kv_cache, meta, backend)
        hidden, residual = self.post_attention_layernorm.add(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        # An uninitialized weight (the loader fills it): nn.Embedding's own init draws normal_, which on the
        # meta device goes through torch's reference decompositions and imports torch._dynamo (0.9 s of
        # start-up).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta, backend):
        hidden = self.embed_tokens(input_ids)
        rotation = self.rotary.rotation(positions, hidden.dtype)  # the same positions in every layer
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rotation, hidden, residual, kv_cache, meta, backend)
        return self.norm.add(hidden, residual)[0] if residual is not None else self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta, backend) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
