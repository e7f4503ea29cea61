"""The CPU's attention backend: the torch backend with decode and prefill through the compiled kernels
(cpu_decode.py, cpu_prefill.py) and RoPE fused with the KV store (fused.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flotilla.engine.kernels import cpu_prefill, fused
from flotilla.engine.kernels.attention import AttentionMetadata, TorchAttentionBackend, block_table_rows
from flotilla.engine.kernels.cpu_decode import paged_decode


@dataclass
class CpuDecodePlan:
    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32


@dataclass
class CpuPrefillPlan:
    kernel: cpu_prefill.PrefillPlan
    meta: AttentionMetadata  # for the torch path's chunks, where the prefill kernel does not serve
    block_size: int
    torch_chunks: object | None = None  # those chunks, planned by the first layer that needs them


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with decode and prefill through the compiled kernels (float32 and bfloat16 caches;
    a chunk of several new tokens, a prompt's or speculative verification's, goes to the prefill kernel
    where its sizes allow, to the torch path elsewhere), and RoPE fused with the KV store
    (fused.rope_and_store)."""

    name = "cpu"

    def plan_prefills(self, meta: AttentionMetadata, block_size: int) -> object:
        requests = meta.prefill_requests
        kernel_plan = cpu_prefill.PrefillPlan.of(
            block_table_rows(meta.block_tables, requests),
            [meta.query_start[r] for r in requests],
            [meta.query_start[r + 1] - meta.query_start[r] for r in requests],
            [meta.context_lens[r] for r in requests],
        )
        return CpuPrefillPlan(kernel_plan, meta, block_size)

    def prefill(self, query, k_cache, v_cache, plan, scale: float, out: torch.Tensor) -> None:
        assert isinstance(plan, CpuPrefillPlan)
        _, num_heads, head_dim = query.shape
        if (
            cpu_prefill.unusable(k_cache.dtype, head_dim, num_heads, k_cache.shape[2])
            or out.dtype != k_cache.dtype
        ):
            if plan.torch_chunks is None:
                plan.torch_chunks = super().plan_prefills(plan.meta, plan.block_size)
            super().prefill(query, k_cache, v_cache, plan.torch_chunks, scale, out)
            return
        cpu_prefill.paged_prefill(query, k_cache, v_cache, plan.kernel, scale, out)

    def plan_decode(self, block_tables: torch.Tensor, seq_lens: list[int], block_size: int) -> object:
        return CpuDecodePlan(
            block_tables.to(torch.int32).contiguous(), torch.tensor(seq_lens, dtype=torch.int32)
        )

    def rotate_and_store(self, qkv, rotation, k_cache, v_cache, meta, num_heads: int, num_kv_heads: int):
        return fused.rope_and_store(
            qkv, rotation, k_cache, v_cache, meta.slot_mapping, num_heads, num_kv_heads
        )

    def decode(self, query, k_cache, v_cache, plan, scale: float) -> torch.Tensor:
        assert isinstance(plan, CpuDecodePlan)
        return paged_decode(query, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale)
