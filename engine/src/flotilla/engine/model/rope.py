"""Rotary position embeddings with Hugging Face's numerics (rotate-half layout), including the linear
and llama3 frequency scalings. cos/sin are precomputed for every position. The serving model (llama.py)
and the synthetic presets' trainer (synthetic/train.py) both use these tables and `rotate`."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def cos_sin_tables(
    head_dim: int, max_positions: int, theta: float, scaling: dict | None, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, [max_positions, head_dim] in float32, each frequency twice
    (the rotate-half layout); the serving model's RotaryEmbedding and the trainer's model both use them."""
    with torch.device(device or "cpu"):
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.args = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build(None)

    def build(self, device) -> None:
        """(Re)compute the tables; the loader calls this after materialising a meta-device model."""
        self.cos, self.sin = cos_sin_tables(*self.args, device=device)

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """cos and sin at `positions`, [T, 1, D] in `dtype`: looked up once per forward, used by every
        layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


Rotation = tuple[torch.Tensor, torch.Tensor]


def rotate(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """x: [..., D], broadcasting against cos and sin: [T, heads, D] with a serving Rotation ([T, 1, D];
    queries and keys together, in one pass), [B, heads, T, D] with the trainer's [T, D] tables; returns a
    rotated copy."""
    cos, sin = rotation
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
