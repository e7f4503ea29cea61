"""Triton kernels for CUDA: paged decode attention and the KV store. Prefill chunks use the torch path
(SDPA over the gathered prefix). Tested on the CPU under TRITON_INTERPRET=1 against attention.py.

Only basic Triton (loads, stores, reductions, a loop) is used, so the kernels build on Triton 3.6 too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.engine.kernels.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    paged_prefill_attention,
)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_vt,
    ROW: tl.constexpr, ROW_POW2: tl.constexpr,
):  # fmt: skip
    # One program per token: copy its [KVH * D] row of K and of V into its slot.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, ROW_POW2)
    mask = offs < ROW
    k = tl.load(key_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key = key.contiguous()
    value = value.contiguous()
    row = key.shape[1] * key.shape[2]
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
        ROW=row, ROW_POW2=triton.next_power_of_2(row),
    )  # fmt: skip


@triton.jit
def _paged_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    # One program per (request, query head): online softmax over the request's KV blocks.
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    seq_len = tl.load(seq_lens_ptr + b)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32)
    m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)
    denom = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    for i in range(0, num_blocks):
        block = tl.load(block_tables_ptr + b * stride_bt + i).to(tl.int64)
        valid = i * BLOCK_SIZE + s < seq_len
        offs = block * stride_cb + kv_head * stride_ch + s[:, None] * stride_cs + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        denom = denom * alpha + tl.sum(p, axis=0)
        m = m_new
    out = acc / denom
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """query [B, H, D]; caches [blocks, block_size, KVH, D]; block_tables [B, max_blocks] int32;
    seq_lens [B] int32 tensor. Same contract as attention.paged_decode_attention."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert k_cache.stride(3) == 1 and query.stride(2) == 1
    out = torch.empty_like(query)
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    _paged_decode_kernel[(batch, num_heads)](
        out, query, k_cache, v_cache, block_tables, seq_lens, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
    )  # fmt: skip
    return out


class TritonAttentionBackend(TorchAttentionBackend):
    name = "triton"

    def store(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        if meta.decode_requests:
            rows = meta.decode_token_index
            reqs = torch.tensor(meta.decode_requests, device=query.device)
            out[rows] = paged_decode_attention(
                query[rows], k_cache, v_cache, meta.block_tables[reqs], meta.seq_lens_tensor[reqs], scale
            )
        for r in meta.prefill_requests:
            start, end = meta.query_start[r], meta.query_start[r + 1]
            out[start:end] = paged_prefill_attention(
                query[start:end], k_cache, v_cache, meta.block_tables[r], meta.context_lens[r], scale
            )
        return out
