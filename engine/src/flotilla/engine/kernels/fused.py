"""RMSNorm (alone, or after the residual add) and SiLU-and-mul, fused: one pass over memory in the CPU's C
library (cpu_ops.c) for float32 and bfloat16 tensors when no gradient is wanted; the torch reference
everywhere else (CUDA, float16, a trainer's autograd, no C compiler).

Both give the same roundings: float32 arithmetic, rounded to the tensor's dtype where the torch code
rounds (the sum of the residual add; the normalised value before the weight; SiLU before the product),
to nearest even; where the CPU has AVX512-BF16 its own conversion rounds, which turns a float32 subnormal
(below 2^-126) into 0 where torch keeps a bfloat16 subnormal. On a bfloat16 decode step of tiny-llama at 48 requests these ops had taken about a sixth of the step in
torch's separate passes, each widening and rounding its operands again.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
import torch.nn.functional as F

from flotilla.engine.kernels import c_library

_I32, _I64, _PTR, _F32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
RMS_NORM_ARGS = [_PTR] * 4 + [_I64, _I64, _F32, _I32]
SILU_AND_MUL_ARGS = [_PTR, _PTR, _I64, _I64, _I32]
ROPE_STORE_ARGS = [_PTR] * 4 + [_I64, _PTR, _PTR, _PTR, _I64, _I32, _I32, _I32, _I32]


@cache
def _functions(dtype: torch.dtype):
    """(rms_norm, silu_and_mul, rope_store) of the C library for `dtype`, or None where it cannot be built."""
    try:
        norm = c_library.function(f"flotilla_rms_norm_{_SUFFIX[dtype]}", RMS_NORM_ARGS)
        silu = c_library.function(f"flotilla_silu_and_mul_{_SUFFIX[dtype]}", SILU_AND_MUL_ARGS)
        rope = c_library.function(f"flotilla_rope_store_{_SUFFIX[dtype]}", ROPE_STORE_ARGS)
    except c_library.KernelUnavailable:
        return None
    return norm, silu, rope


def _c_path(*tensors: torch.Tensor):
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _SUFFIX or torch.is_grad_enabled():
        return None
    if any(t.dtype != first.dtype or not t.is_contiguous() for t in tensors):
        return None
    return _functions(first.dtype)


# -- the torch references ---------------------------------------------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 like transformers, then scale in the model dtype.
    dtype = x.dtype
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(dtype)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# -- the ops ----------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    fns = _c_path(x, weight)
    if fns is None or x.dim() != 2:
        return rms_norm_reference(x, weight, eps)
    out = torch.empty_like(x)
    fns[0](out.data_ptr(), x.data_ptr(), None, weight.data_ptr(), x.shape[0], x.shape[1], eps,
           torch.get_num_threads())  # fmt: skip
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). The C path writes the sum into `residual`'s memory (the
    running residual stream, which nothing else holds); the reference leaves its inputs alone."""
    fns = _c_path(x, residual, weight)
    if fns is None or x.dim() != 2 or x.shape != residual.shape:
        total = x + residual
        return rms_norm_reference(total, weight, eps), total
    out = torch.empty_like(x)
    fns[0](out.data_ptr(), x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps,
           torch.get_num_threads())  # fmt: skip
    return out, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * inner] holding gate then up."""
    fns = _c_path(gate_up)
    if fns is None or gate_up.dim() != 2:
        return silu_and_mul_reference(gate_up)
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inner))
    fns[1](out.data_ptr(), gate_up.data_ptr(), rows, inner, torch.get_num_threads())
    return out


def rope_and_store(
    qkv: torch.Tensor,  # [T, (heads + 2 kv_heads) * head_dim]: queries, keys, values
    rotation: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, head_dim] in qkv's dtype
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor | None:
    """The rotated queries [T, heads, head_dim], with the rotated keys and the values written into the caches
    at slot_mapping, in one pass of the C library; None where it does not serve (the caller then rotates and
    stores with torch). Rounded as model/rope.py's `rotate` rounds, bit for bit."""
    cos, sin = rotation
    head_dim = k_cache.shape[-1]
    fns = _c_path(qkv, cos, sin, k_cache, v_cache)
    if fns is None or qkv.dim() != 2 or head_dim % 16 or slot_mapping.dtype != torch.int64:
        return None
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or not slot_mapping.is_contiguous():
        return None
    tokens = qkv.shape[0]
    q = qkv.new_empty((tokens, num_heads, head_dim))
    fns[2](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), qkv.data_ptr(), qkv.stride(0), cos.data_ptr(),
           sin.data_ptr(), slot_mapping.data_ptr(), tokens, num_heads, num_kv_heads, head_dim,
           torch.get_num_threads())  # fmt: skip
    return q
