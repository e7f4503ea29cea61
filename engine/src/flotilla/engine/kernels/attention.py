"""Paged attention in pure torch: the reference implementation and the CPU path.

The KV cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]. A token at
position p of a request lives in slot block_table[p // block_size] * block_size + p % block_size.
Queries of one step are flattened over requests; each request contributes a chunk of new tokens that
attends, causally, to its cached prefix plus the chunk itself. GQA: query head h reads KV head
h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Decode requests are attended in groups of similar length, padded to the group's longest. 16 beat 8, 32
# and 64 on 2 CPU cores (tiny-llama, 64 requests): less padding, still few calls.
DECODE_GROUP = 16

# The torch.profiler range around one layer's KV store and attention (any backend): `bench offline` groups
# the self time of everything under it as attention.
ATTENTION_LABEL = "flotilla.attention"


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    query_start: list[int]  # per request, offset of its first new token in the flat batch (+ total)
    context_lens: list[int]  # per request, tokens already cached before this step
    seq_lens: list[int]  # per request, context + new tokens
    block_tables: torch.Tensor  # [R, max_blocks] int32, padded with 0
    seq_lens_tensor: torch.Tensor  # [R] int32 on the device
    decode_requests: list[int]  # requests with exactly one new token
    prefill_requests: list[int]  # requests with a chunk of several new tokens
    decode_token_index: torch.Tensor  # [len(decode_requests)] long: their tokens in the flat batch
    # What a backend derives from the above once per step and reuses in every layer (device tensors such
    # as the Triton prefill's tile table). The torch path leaves it empty.
    backend_cache: dict[str, object] = field(default_factory=dict)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """key/value: [T, KVH, D], written at slot_mapping into the paged caches."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Whole blocks of a cache, in order: [len(block_ids), block_size, KVH, D]. index_select over rows of
    one block each copies about twice as fast on CPU as advanced indexing."""
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.long())
    return rows.view(-1, *cache.shape[1:])


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one request's K or V: [length, KVH, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return gather_blocks(cache, block_table[:num_blocks]).flatten(0, 1)[:length]


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D], one token per request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Reference decode attention: each query attends to all seq_len cached tokens of its request."""
    out = torch.empty_like(query)
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    for start in range(0, len(order), DECODE_GROUP):
        group = order[start : start + DECODE_GROUP]
        idx = torch.tensor(group, device=query.device)
        out[idx] = _decode_group(
            query[idx], k_cache, v_cache, block_tables[idx], [seq_lens[i] for i in group], scale
        )
    return out


def _decode_group(query, k_cache, v_cache, block_tables, seq_lens, scale):
    block_size = k_cache.shape[1]
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks].flatten()
    batch = block_tables.shape[0]
    # Gather each request's blocks: [B, L, KVH, D] -> [B, KVH, L, D], padded to the group's longest.
    keys = gather_blocks(k_cache, tables).view(batch, -1, *k_cache.shape[2:])[:, :max_len].transpose(1, 2)
    values = gather_blocks(v_cache, tables).view(batch, -1, *v_cache.shape[2:])[:, :max_len].transpose(1, 2)
    lens = torch.tensor(seq_lens, device=query.device)
    valid = torch.arange(max_len, device=query.device)[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :], keys, values, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out[:, :, 0]


def paged_prefill_attention(
    query: torch.Tensor,  # [n, H, D], the new tokens of one request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """A chunk of n new tokens at positions context_len .. context_len+n-1 attends causally to the
    cached prefix and to itself (its K/V are already stored)."""
    n = query.shape[0]
    total = context_len + n
    keys = gather_kv(k_cache, block_table, total).transpose(0, 1)  # [KVH, L, D]
    values = gather_kv(v_cache, block_table, total).transpose(0, 1)
    q = query.transpose(0, 1)  # [H, n, D]
    if context_len == 0:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        rows = torch.arange(n, device=query.device)[:, None] + context_len
        cols = torch.arange(total, device=query.device)[None, :]
        mask = cols <= rows
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


class TorchAttentionBackend:
    name = "torch"

    def store(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        if meta.decode_requests:
            rows = meta.decode_token_index
            reqs = meta.decode_requests
            out[rows] = paged_decode_attention(
                query[rows],
                k_cache,
                v_cache,
                meta.block_tables[reqs],
                [meta.seq_lens[r] for r in reqs],
                scale,
            )
        for r in meta.prefill_requests:
            start, end = meta.query_start[r], meta.query_start[r + 1]
            out[start:end] = paged_prefill_attention(
                query[start:end], k_cache, v_cache, meta.block_tables[r], meta.context_lens[r], scale
            )
        return out
