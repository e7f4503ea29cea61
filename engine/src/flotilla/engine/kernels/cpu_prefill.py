"""The CPU's paged prefill kernel (paged_prefill.c, float32 and bfloat16 caches) called on torch tensors'
memory: chunks of new tokens attend causally to their cached context and to themselves, read straight from
the paged cache. The library is built and loaded by c_library.py."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from flotilla.engine.kernels import c_library

SYMBOLS = {torch.float32: "flotilla_paged_prefill_f32", torch.bfloat16: "flotilla_paged_prefill_bf16"}
# paged_prefill.c's PREFILL_MAX_HEAD_DIM and TILE_ROWS (the most query heads per KV head).
MAX_HEAD_DIM, MAX_GROUP = 256, 64
_I32, _I64, _PTR = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_ARGS = [_PTR] * 4 + [_I64] + [_PTR] * 4 + [_I32] * 5 + [ctypes.c_float, _I32]


@cache
def kernel(dtype: torch.dtype):
    """The prefill entry point for caches of `dtype`; raises KernelUnavailable with the reason."""
    return c_library.function(SYMBOLS[dtype], _ARGS, ctypes.c_int32)


@cache
def vector_lanes() -> int:
    """The floats per vector of the built prefill kernel (16 with AVX-512, else 8): head_dim must be a
    multiple of it. Raises KernelUnavailable."""
    return c_library.function("flotilla_paged_prefill_lanes", [], ctypes.c_int32)()


@cache
def rounds_weights(head_dim: int) -> bool:
    """Whether the built kernel rounds the softmax's numerators to bfloat16 before weighting the values, for
    bfloat16 caches of head_dim (its AVX512-BF16 path: as transformers' eager attention and FlashAttention
    do); float32 caches never. Raises KernelUnavailable."""
    return bool(c_library.function("flotilla_paged_prefill_rounds_weights", [_I32], _I32)(head_dim))


@cache
def unusable(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
    """None when the kernel serves this KV dtype and these sizes (on the CPU); otherwise why not."""
    if dtype not in SYMBOLS:
        return f"it reads float32 and bfloat16 caches, the dtype is {str(dtype).removeprefix('torch.')}"
    try:
        kernel(dtype)
        lanes = vector_lanes()
    except c_library.KernelUnavailable as exc:
        return str(exc)
    if head_dim % lanes or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim}: it handles multiples of {lanes} up to {MAX_HEAD_DIM}"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads} heads over {num_kv_heads} KV heads: it handles up to {MAX_GROUP} per KV head"
    return None


@dataclass
class PrefillPlan:
    """A step's chunks, as the kernel reads them (built once a step, reused by every layer)."""

    block_tables: torch.Tensor  # [C, max_blocks] int32, rows contiguous: each chunk's request's table
    rows: torch.Tensor  # [C] int32: the chunk's first row in the flat batch
    lens: torch.Tensor  # [C] int32: its new tokens
    context_lens: torch.Tensor  # [C] int32: tokens cached before it

    @classmethod
    def of(cls, block_tables: torch.Tensor, rows: list[int], lens: list[int], context_lens: list[int]):
        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32)

        tables = block_tables.to(torch.int32).contiguous()
        return cls(tables, ints(rows), ints(lens), ints(context_lens))


def paged_prefill(
    query: torch.Tensor,  # [T, H, D] in the caches' dtype (another is cast): every row of the step (only the chunks' rows are read)
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] float32 or bfloat16, contiguous
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    out: torch.Tensor,  # [T, H, D] in the caches' dtype, contiguous: the chunks' rows are written
) -> None:
    """Causal attention of each chunk's rows over its request's context and itself; the caller checked
    `unusable` for these sizes."""
    tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out.dtype != k_cache.dtype:
        raise ValueError(f"out is {out.dtype}, the caches {k_cache.dtype}: out must be in the caches' dtype")
    if not (out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("out, k_cache and v_cache must be contiguous")
    q = query.to(k_cache.dtype).contiguous()  # read in the caches' dtype (it adds in float32)
    status = kernel(k_cache.dtype)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), plan.block_tables.data_ptr(),
        plan.block_tables.stride(0), plan.rows.data_ptr(), plan.lens.data_ptr(), plan.context_lens.data_ptr(),
        out.data_ptr(), plan.rows.shape[0], num_heads, num_kv_heads, head_dim, block_size, scale,
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(
            f"the prefill kernel refused these sizes: {unusable(k_cache.dtype, head_dim, num_heads, num_kv_heads)}"
        )
