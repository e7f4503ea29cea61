"""The CPU's paged decode kernel (paged_decode.c, float32 and bfloat16 caches) called on torch tensors'
memory (cpu_attention.py's backend uses it). The library is built and loaded by c_library.py."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from flotilla.engine.kernels import c_library

# The kernel's entry point per cache dtype: queries and outputs are in that dtype too.
SYMBOLS = {torch.float32: "flotilla_paged_decode_f32", torch.bfloat16: "flotilla_paged_decode_bf16"}
# paged_decode.c's MAX_HEAD_DIM, MAX_GROUP and MAX_BLOCK.
MAX_HEAD_DIM, MAX_GROUP, MAX_BLOCK = 256, 16, 64
_I32, _I64, _PTR = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_ARGS = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I32, _I32, _I32, _I32, _I32, ctypes.c_float, _I32]


@cache
def kernel(dtype: torch.dtype):
    """The decode entry point for caches of `dtype`; raises KernelUnavailable with the reason."""
    return c_library.function(SYMBOLS[dtype], _ARGS, ctypes.c_int32)


def vector_lanes() -> int:
    """The floats per vector of the built kernel: 16 with AVX-512 and its bfloat16 dot products (head_dim a
    multiple of 32 then takes that path), else 8. Raises KernelUnavailable."""
    return c_library.function("flotilla_paged_decode_lanes", [], ctypes.c_int32)()


def shape_limits(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int) -> str | None:
    """None when the kernel handles these sizes (its stack arrays are fixed); otherwise which one not."""
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim}: it handles multiples of 8 up to {MAX_HEAD_DIM}"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads} heads over {num_kv_heads} KV heads: it handles up to {MAX_GROUP} per KV head"
    if block_size > MAX_BLOCK:
        return f"block_size {block_size}: it handles up to {MAX_BLOCK}"
    return None


def unusable(device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int,
             block_size: int) -> str | None:  # fmt: skip
    """None when the kernel serves this device, KV dtype and model; otherwise why not."""
    if device.type != "cpu":
        return f"it runs on the CPU, the device is {device.type}"
    if dtype not in SYMBOLS:
        return f"it reads float32 and bfloat16 caches, the dtype is {str(dtype).removeprefix('torch.')}"
    if reason := shape_limits(head_dim, num_heads, num_kv_heads, block_size):
        return reason
    try:
        kernel(dtype)
    except c_library.KernelUnavailable as exc:
        return str(exc)
    return None


def paged_decode(
    query: torch.Tensor,  # [B, H, D] in the caches' dtype (another is cast)
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] float32 or bfloat16, contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, >= ceil(max seq_len / block_size)] int32, rows contiguous
    seq_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
) -> torch.Tensor:
    """Decode attention of one query token per request; the output is in the caches' dtype (the kernel
    adds in float32 and rounds once)."""
    query = query.to(k_cache.dtype).contiguous()
    batch, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and cache_dim == head_dim):
        raise ValueError(
            f"caches must be contiguous [blocks, block_size, KVH, {head_dim}], got {k_cache.shape}"
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables and seq_lens must be int32, block_tables' rows contiguous")
    if reason := shape_limits(head_dim, num_heads, num_kv_heads, block_size):
        raise ValueError(reason)
    if k_cache.dtype not in SYMBOLS or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches must be float32 or bfloat16, got {k_cache.dtype} and {v_cache.dtype}")
    out = torch.empty_like(query)
    if batch == 0:
        return out
    kernel(k_cache.dtype)(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
        batch, num_heads, num_kv_heads, head_dim, block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    return out
