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

# The torch.profiler range around one layer's RoPE, KV store and attention (any backend): `bench offline`
# groups the self time of everything under it as attention.
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
    # Set for a CUDA graph's step (worker/cuda_graphs.py): every row decodes, and attention sizes its launch
    # for sequences up to this length instead of reading this step's lengths on the host.
    decode_len_bound: int | None = None
    # What a backend derives from the above once per step and reuses in every layer (device tensors such
    # as the Triton prefill's tile table). The torch path leaves it empty.
    backend_cache: dict[str, object] = field(default_factory=dict)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """key/value: [T, KVH, D], written at slot_mapping into the paged caches."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def block_table_rows(block_tables: torch.Tensor, requests: list[int]) -> torch.Tensor:
    """The block tables of `requests` (the whole tensor, uncopied, when they are every request)."""
    return block_tables if len(requests) == block_tables.shape[0] else block_tables[requests]


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Whole blocks of a cache, in order: [len(block_ids), block_size, KVH, D]. index_select over rows of
    one block each copies about twice as fast on CPU as advanced indexing."""
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.long())
    return rows.view(-1, *cache.shape[1:])


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D], one token per request
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Reference decode attention: each query attends to all seq_len cached tokens of its request."""
    return decode_attention(
        query, k_cache, v_cache, decode_groups(block_tables, seq_lens, k_cache.shape[1]), scale
    )


def decode_attention(query, k_cache, v_cache, groups: list[DecodeGroup], scale: float) -> torch.Tensor:
    out = torch.empty_like(query)
    for group in groups:
        rows = group.rows
        if rows is None:
            return _decode_group(query, k_cache, v_cache, group, scale)
        out[rows] = _decode_group(query[rows], k_cache, v_cache, group, scale)
    return out


@dataclass
class DecodeGroup:
    """Decode requests attended in one call, and what every layer reuses for them."""

    rows: torch.Tensor | None  # their rows among the decode queries; None: all of them, in order
    block_ids: torch.Tensor  # [B * num_blocks] long: each request's first num_blocks blocks
    max_len: int
    valid: torch.Tensor  # [B, 1, 1, max_len] bool: which of the padded positions exist


def decode_groups(block_tables: torch.Tensor, seq_lens: list[int], block_size: int) -> list[DecodeGroup]:
    """Groups of similar length (sorted), or one group in the given order when they fit in one."""
    device = block_tables.device
    if len(seq_lens) <= DECODE_GROUP:
        return [_decode_group_plan(None, block_tables, seq_lens, block_size)]
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups = []
    for start in range(0, len(order), DECODE_GROUP):
        members = order[start : start + DECODE_GROUP]
        rows = torch.tensor(members, device=device)
        groups.append(
            _decode_group_plan(rows, block_tables[rows], [seq_lens[i] for i in members], block_size)
        )
    return groups


def _decode_group_plan(rows, block_tables, seq_lens: list[int], block_size: int) -> DecodeGroup:
    device = block_tables.device
    max_len = max(seq_lens)
    lens = torch.tensor(seq_lens, device=device)
    valid = torch.arange(max_len, device=device)[None, :] < lens[:, None]
    block_ids = block_tables[:, : -(-max_len // block_size)].flatten().long()
    return DecodeGroup(rows, block_ids, max_len, valid[:, None, None, :])


def _decode_group(query, k_cache, v_cache, group: DecodeGroup, scale):
    batch = query.shape[0]
    # Gather each request's blocks: [B, L, KVH, D] -> [B, KVH, L, D], padded to the group's longest.
    keys = gather_blocks(k_cache, group.block_ids).view(batch, -1, *k_cache.shape[2:])[:, : group.max_len]
    values = gather_blocks(v_cache, group.block_ids).view(batch, -1, *v_cache.shape[2:])[:, : group.max_len]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :],
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=group.valid,
        scale=scale,
        enable_gqa=True,
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
    chunk = prefill_chunk(0, query.shape[0], block_table, context_len, k_cache.shape[1])
    return chunk_attention(query, k_cache, v_cache, chunk, scale)


@dataclass
class PrefillChunk:
    """One request's chunk of new tokens, and what every layer reuses for it."""

    start: int  # its rows in the flat batch
    end: int
    block_ids: torch.Tensor  # the blocks holding its context and itself
    total: int  # context + chunk
    mask: torch.Tensor | None  # [n, total] causal mask past a context; None: plain causal (no context)


def prefill_chunk(
    start: int, end: int, block_table: torch.Tensor, context_len: int, block_size: int
) -> PrefillChunk:
    n = end - start
    total = context_len + n
    block_ids = block_table[: -(-total // block_size)]
    mask = None
    if context_len:
        rows = torch.arange(n, device=block_table.device)[:, None] + context_len
        mask = torch.arange(total, device=block_table.device)[None, :] <= rows
    return PrefillChunk(start, end, block_ids, total, mask)


def chunk_attention(query, k_cache, v_cache, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    keys = gather_blocks(k_cache, chunk.block_ids).flatten(0, 1)[: chunk.total].transpose(0, 1)  # [KVH, L, D]
    values = gather_blocks(v_cache, chunk.block_ids).flatten(0, 1)[: chunk.total].transpose(0, 1)
    q = query.transpose(0, 1)  # [H, n, D]
    if chunk.mask is None:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=chunk.mask, scale=scale, enable_gqa=True
        )
    return out.transpose(0, 1)


@dataclass
class _StepPlan:
    decode: object | None  # what the backend's decode() reuses in every layer; None: no decode requests
    decode_rows: torch.Tensor | None  # the decode queries' rows; None: every row, in order
    prefills: object | None  # what the backend's prefill() reuses in every layer; None: no prefill chunks


class TorchAttentionBackend:
    """Decode in length groups over gathered blocks, each prefill chunk over its gathered blocks: the
    reference, and the CPU path where the compiled kernels (cpu_attention.CpuAttentionBackend) do not serve."""

    name = "torch"

    def store(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    def rotate_and_store(self, qkv, rotation, k_cache, v_cache, meta: AttentionMetadata, num_heads: int,
                         num_kv_heads: int) -> torch.Tensor | None:  # fmt: skip
        """A backend that fuses RoPE with its KV store returns the rotated queries, having stored the rotated
        keys and the values; this one does not (None: the model rotates, then calls store)."""
        return None

    def plan_decode(self, block_tables: torch.Tensor, seq_lens: list[int], block_size: int) -> object:
        return decode_groups(block_tables, seq_lens, block_size)

    def decode(self, query, k_cache, v_cache, plan, scale: float) -> torch.Tensor:
        return decode_attention(query, k_cache, v_cache, plan, scale)

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # What does not depend on the layer (groups, masks, block ids) is planned once per step.
        plan = meta.backend_cache.get(self.name)
        if plan is None:
            plan = meta.backend_cache[self.name] = self._plan(meta, k_cache.shape[1])
        assert isinstance(plan, _StepPlan)
        if plan.decode is not None and plan.prefills is None:
            return self.decode(query, k_cache, v_cache, plan.decode, scale)
        out = torch.empty_like(query)
        if plan.decode is not None:
            rows = plan.decode_rows
            out[rows] = self.decode(query[rows], k_cache, v_cache, plan.decode, scale)
        if plan.prefills is not None:
            self.prefill(query, k_cache, v_cache, plan.prefills, scale, out)
        return out

    def plan_prefills(self, meta: AttentionMetadata, block_size: int) -> object:
        """What prefill() reuses in every layer for the step's chunks (there is at least one)."""
        return [
            prefill_chunk(
                meta.query_start[r],
                meta.query_start[r + 1],
                meta.block_tables[r],
                meta.context_lens[r],
                block_size,
            )
            for r in meta.prefill_requests
        ]

    def prefill(self, query, k_cache, v_cache, plan, scale: float, out: torch.Tensor) -> None:
        """Writes each chunk's attention into its rows of `out`."""
        for chunk in plan:
            out[chunk.start : chunk.end] = chunk_attention(
                query[chunk.start : chunk.end], k_cache, v_cache, chunk, scale
            )

    def _plan(self, meta: AttentionMetadata, block_size: int) -> _StepPlan:
        decode = None
        decode_rows = None
        if meta.decode_requests:
            reqs = meta.decode_requests
            tables = block_table_rows(meta.block_tables, reqs)
            decode = self.plan_decode(tables, [meta.seq_lens[r] for r in reqs], block_size)
            if meta.prefill_requests:
                decode_rows = meta.decode_token_index
        prefills = self.plan_prefills(meta, block_size) if meta.prefill_requests else None
        return _StepPlan(decode, decode_rows, prefills)
