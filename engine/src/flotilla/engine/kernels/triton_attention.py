"""Triton kernels for CUDA: the KV store, paged prefill attention (varlen, causal, the whole batch in one
launch) and paged decode attention. Tested on the CPU under TRITON_INTERPRET=1 against attention.py.

Prefill covers fresh prompts and chunks after a cached prefix alike: a request's new tokens sit at
positions context_len .. seq_len - 1 and attend, causally by absolute position, to everything before
them, read through the block table (the model stores the new tokens' K/V before attending, so the chunk
reads itself from the cache too). The grid is (query tiles over all requests, KV heads): the host cuts
each request's new tokens into tiles of BLOCK_M tokens, once per step (a small table: request, first
token, token count, first position), so a batch of one long prompt and many short ones launches exactly
the programs it needs, with none idling past the end of a short request as a (requests x max tiles)
grid would. Each program takes the BLOCK_M tokens x GROUP query heads that share its KV head as the rows
of one tile (GQA grouping, as in decode): the KV blocks are read once per group, not once per query head.
It walks the KV up to its last token's position in tiles of at least 64 tokens (several blocks when
blocks are small) with an online softmax, and writes its rows into the packed [tokens, heads, head_dim]
output.

Decode is grouped and split (flash-decoding). One program per (request, KV head, split) loads the
query rows of all the query heads that share the KV head as one tile and reads the KV head's blocks
once for all of them (`tl.dot`), where the earlier kernel ran one program per query head and so read
each KV head once per query head: GROUP times the cache traffic under GQA, and decode is bound by that
traffic. Long contexts are cut into splits (`decode_splits`) so a small batch still fills the GPU; each
split writes its partial output and log-sum-exp, and a small combine kernel weights them into the
output. One split (short contexts) writes the output directly.

Every `tl.dot` has all dimensions >= 16 (MIN_DOT), as real GPUs need. Only loads, stores, reductions,
`tl.dot` and a loop are used, so the kernels build on Triton 3.6 too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import torch
import triton
import triton.language as tl

from flotilla.engine.kernels.attention import AttentionMetadata, TorchAttentionBackend

T = TypeVar("T")


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


# Split-KV (flash-decoding): a split covers at least MIN_SPLIT_TOKENS tokens and MIN_SPLIT_BLOCKS blocks,
# so short contexts run in one split (written straight to the output) and only long ones pay for the
# partial outputs and the combine; MAX_SPLITS bounds the scratch buffers.
MIN_SPLIT_TOKENS = 256
MIN_SPLIT_BLOCKS = 4
MAX_SPLITS = 16
# tl.dot needs every dimension of its operands to be at least 16 on the GPU.
MIN_DOT = 16


def decode_splits(max_seq_len: int, block_size: int) -> int:
    """How many splits the decode kernel cuts each sequence's KV into, from the longest context: as many
    as fit with each covering at least MIN_SPLIT_TOKENS tokens and MIN_SPLIT_BLOCKS blocks, between 1
    and MAX_SPLITS."""
    min_blocks = max(MIN_SPLIT_BLOCKS, -(-MIN_SPLIT_TOKENS // block_size))
    num_blocks = -(-max_seq_len // block_size)
    return max(1, min(MAX_SPLITS, num_blocks // min_blocks))


@triton.jit
def _attend_kv_tile(
    q, q_pos, m, denom, acc, pos, kv_end, k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head, d, scale,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One KV tile of the paged cache (token positions `pos`, read through the block table) folded into
    the online softmax of the query rows `q`: returns the new running max, sum and accumulator. Keys at or
    past `kv_end` are masked; with CAUSAL, so is every key after its row's position `q_pos`."""
    valid = pos < kv_end
    block = tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offs = block[:, None] * stride_cb + (pos % BLOCK_SIZE)[:, None] * stride_cs + kv_head * stride_ch
    offs = offs + d[None, :]
    k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [rows, TILE]
    keep = valid[None, :]
    if CAUSAL:
        keep = keep & (pos[None, :] <= q_pos[:, None])
    scores = tl.where(keep, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, denom * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _paged_decode_kernel(
    o_ptr, lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
    tiles_per_split,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    stride_bt, stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # One program per (request, KV head, split): the GROUP query heads that share the KV head, as the
    # rows of one [GROUP_PAD, HEAD_DIM] tile, attend to the split's tiles of TILE tokens (TILE is the
    # block size, or 16 tokens over several blocks when blocks are smaller) with an online softmax.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    r = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, TILE)
    rows = r < GROUP
    heads = kv_head * GROUP + r
    q_offs = b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=rows[:, None], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(tl.cdiv(seq_len, TILE), first + tiles_per_split)
    for i in range(first, last):
        m, denom, acc = _attend_kv_tile(
            q, 0, m, denom, acc, i * TILE + t, seq_len, k_cache_ptr, v_cache_ptr,
            block_tables_ptr + b * stride_bt, kv_head, d, scale, stride_cb, stride_cs, stride_ch,
            BLOCK_SIZE, False, DOT_PRECISION,
        )  # fmt: skip
    # A split past the end of a shorter request has no tokens: output 0 and log-sum-exp -inf (weight 0).
    nonempty = denom > 0
    safe_denom = tl.where(nonempty, denom, 1.0)
    out = acc / safe_denom[:, None]
    o_offs = b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=rows[:, None])
    if WRITE_LSE:
        lse = tl.where(nonempty, m + tl.log(safe_denom), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=rows)


@triton.jit
def _combine_splits_kernel(
    out_ptr, partial_ptr, lse_ptr, num_splits,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    SPLITS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    # One program per (request, query head): the splits' outputs weighted by exp(lse - max lse).
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_POW2)
    d = tl.arange(0, HEAD_DIM)
    present = s < num_splits
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=present, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))
    partial = tl.load(
        partial_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=present[:, None], other=0.0,
    )  # fmt: skip
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len: int | None = None
) -> torch.Tensor:
    """query [B, H, D]; caches [blocks, block_size, KVH, D]; block_tables [B, max_blocks] int32;
    seq_lens [B] int32 tensor. Same contract as attention.paged_decode_attention. max_seq_len (the
    largest of seq_lens, when the caller knows it) saves reading seq_lens back from the device."""
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
    num_splits = decode_splits(max_seq_len, k_cache.shape[1])
    return _decode(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, num_splits)


def _decode(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len: int, num_splits: int):
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert head_dim & (head_dim - 1) == 0 and head_dim >= MIN_DOT, "head_dim must be a power of two >= 16"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert num_heads % num_kv_heads == 0
    assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride() and query.stride(2) == 1
    out = torch.empty_like(query)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    tile = max(block_size, MIN_DOT)
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    max_tiles = -(-max_seq_len // tile)
    tiles_per_split = max(1, -(-max_tiles // num_splits))
    if num_splits == 1:
        o, lse = out, out  # lse unused
        o_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
        o_strides = (o.stride(0), o.stride(1), o.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        o, lse, query, k_cache, v_cache, block_tables, seq_lens, scale, tiles_per_split,
        query.stride(0), query.stride(1), *o_strides, *lse_strides,
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), MIN_DOT), BLOCK_SIZE=block_size, TILE=tile,
        HEAD_DIM=head_dim, WRITE_LSE=num_splits > 1,
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else None,  # fp32 exact, not tf32
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(batch, num_heads)](
            out, o, lse, num_splits, out.stride(0), out.stride(1), o.stride(0), o.stride(1), o.stride(2),
            lse.stride(0), lse.stride(1), SPLITS_POW2=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        )  # fmt: skip
    return out


# Prefill tiles: BLOCK_M tokens x GROUP_PAD query heads make PREFILL_ROWS rows (so at least MIN_DOT tokens'
# worth of rows whatever the group), against KV tiles of at least PREFILL_KV_TILE tokens.
PREFILL_ROWS = 64
PREFILL_KV_TILE = 64


@triton.jit
def _paged_prefill_kernel(
    o_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, tiles_ptr, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # One program per (query tile, KV head). Row i of the tile is token i // GROUP_PAD of the tile and
    # query head kv_head * GROUP + i % GROUP_PAD; rows past the tile's tokens or the group are masked.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tiles_ptr + tile * 4)
    tok0 = tl.load(tiles_ptr + tile * 4 + 1)
    count = tl.load(tiles_ptr + tile * 4 + 2)
    pos0 = tl.load(tiles_ptr + tile * 4 + 3)
    i = tl.arange(0, BLOCK_M * GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, TILE)
    tok = i // GROUP_PAD
    g = i % GROUP_PAD
    rows = (tok < count) & (g < GROUP)
    heads = kv_head * GROUP + g
    token = (tok0 + tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=rows[:, None],
        other=0.0,
    )
    q_pos = pos0 + tok
    # Keys up to the tile's last token. Every row sees position 0 in the first KV tile (padding rows
    # have q_pos past the end), so the running max is finite from then on and no row divides by zero.
    kv_end = pos0 + count
    m = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], tl.float32)
    for j in range(0, tl.cdiv(kv_end, TILE)):
        m, denom, acc = _attend_kv_tile(
            q, q_pos, m, denom, acc, j * TILE + t, kv_end, k_cache_ptr, v_cache_ptr,
            block_tables_ptr + req * stride_bt, kv_head, d, scale, stride_cb, stride_cs, stride_ch,
            BLOCK_SIZE, True, DOT_PRECISION,
        )  # fmt: skip
    out = acc / denom[:, None]
    o_offs = token[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=rows[:, None])


def prefill_block_m(group: int) -> int:
    """Tokens per prefill query tile: PREFILL_ROWS rows over the group's (padded) query heads."""
    return max(1, PREFILL_ROWS // triton.next_power_of_2(group))


def prefill_tiles(query_start, context_lens, requests, block_m: int, device) -> torch.Tensor:
    """The prefill launch's tile table, [tiles, 4] int32: (request, first token in the flat batch, tokens,
    position of the first token), each request's new tokens cut into tiles of block_m."""
    rows = []
    for r in requests:
        start, end = query_start[r], query_start[r + 1]
        for tok in range(start, end, block_m):
            rows.append((r, tok, min(block_m, end - tok), context_lens[r] + tok - start))
    return torch.tensor(rows, dtype=torch.int32).view(-1, 4).to(device)


def paged_prefill_attention(query, k_cache, v_cache, block_tables, tiles, scale, out=None) -> torch.Tensor:
    """query [T, H, D], the new tokens of all requests, packed; caches [blocks, block_size, KVH, D] with
    the new tokens' K/V already stored; block_tables [R, max_blocks] int32; tiles from prefill_tiles
    (with block_m = prefill_block_m(H // KVH)). Writes the tiles' rows of `out` (a new tensor like query
    when None) and returns it; rows no tile covers are left as they were."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert head_dim & (head_dim - 1) == 0 and head_dim >= MIN_DOT, "head_dim must be a power of two >= 16"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert num_heads % num_kv_heads == 0
    assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride() and query.stride(2) == 1
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(2) == 1
    if tiles.shape[0] == 0:
        return out
    group = num_heads // num_kv_heads
    _paged_prefill_kernel[(tiles.shape[0], num_kv_heads)](
        out, query, k_cache, v_cache, block_tables, tiles, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_M=prefill_block_m(group),
        BLOCK_SIZE=block_size, TILE=max(block_size, PREFILL_KV_TILE), HEAD_DIM=head_dim,
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else None,  # fp32 exact, not tf32
    )  # fmt: skip
    return out


class TritonAttentionBackend(TorchAttentionBackend):
    name = "triton"

    def store(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.decode_len_bound is not None:  # a CUDA graph's step: static tensors only, no host values
            return paged_decode_attention(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor, scale, max_seq_len=meta.decode_len_bound
            )  # fmt: skip
        out = torch.empty_like(query)
        if meta.prefill_requests:
            # All prefill chunks in one launch, with tables built once per step and reused by every layer.
            block_m = prefill_block_m(query.shape[1] // k_cache.shape[2])
            tiles = _per_step(
                meta, f"prefill_tiles_{block_m}",
                lambda: prefill_tiles(meta.query_start, meta.context_lens, meta.prefill_requests, block_m, query.device),
            )  # fmt: skip
            block_tables = _per_step(
                meta, "block_tables_int32", lambda: meta.block_tables.to(torch.int32).contiguous()
            )
            paged_prefill_attention(query, k_cache, v_cache, block_tables, tiles, scale, out=out)
        if meta.decode_requests:
            block_tables, seq_lens, max_seq_len = _per_step(
                meta, "decode_rows", lambda: _decode_rows(meta, query.device)
            )
            out[meta.decode_token_index] = paged_decode_attention(
                query[meta.decode_token_index], k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len
            )  # fmt: skip
        return out


def _per_step(meta: AttentionMetadata, key: str, build: Callable[[], T]) -> T:
    """What `build` makes from the step's metadata, made once per step and shared by every layer."""
    if key not in meta.backend_cache:
        meta.backend_cache[key] = build()
    return cast(T, meta.backend_cache[key])


def _decode_rows(meta: AttentionMetadata, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The decode requests' block tables and lengths, and the longest (chosen on the host: no GPU sync)."""
    requests = torch.tensor(meta.decode_requests, device=device)
    longest = max(meta.seq_lens[r] for r in meta.decode_requests)
    return meta.block_tables[requests], meta.seq_lens_tensor[requests], longest
