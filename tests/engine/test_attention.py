"""Paged attention: the torch reference against plain dense attention, and the Triton kernels (run by
Triton's CPU interpreter, TRITON_INTERPRET=1) against the reference, over block sizes, GQA ratios,
head dims 64 and 128, and ragged lengths."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flotilla.engine.kernels import attention


def random_paged(seq_lens, num_kv_heads, head_dim, block_size, seed=0):
    """A KV cache holding each sequence in shuffled blocks, plus dense copies for checking."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, dense_k, dense_v = [], [], []
    for n, nb in zip(seq_lens, blocks_per_seq, strict=True):
        ids = [order.pop() for _ in range(nb)]
        tables.append(ids + [0] * (max(blocks_per_seq) - nb))
        dense_k.append(k_cache[ids].flatten(0, 1)[:n])
        dense_v.append(v_cache[ids].flatten(0, 1)[:n])
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), dense_k, dense_v


def dense_attention(q, k, v, scale, causal_offset=None):
    """q [n, H, D], k/v [L, KVH, D]; plain softmax attention with repeated KV heads."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    if causal_offset is not None:
        n, L = q.shape[0], k.shape[0]
        mask = torch.arange(L)[None, :] > torch.arange(n)[:, None] + causal_offset
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


SHAPES = [
    # block_size, num_heads, num_kv_heads, head_dim, seq_lens
    (16, 8, 8, 64, [1, 16, 17, 40]),
    (16, 8, 2, 64, [5, 33, 64, 2]),
    (8, 8, 1, 128, [9, 1, 30]),
    (32, 4, 2, 128, [70, 31, 3]),
]


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,seq_lens", SHAPES)
def test_torch_decode_reference_matches_dense(block_size, heads, kv_heads, head_dim, seq_lens):
    k_cache, v_cache, tables, dense_k, dense_v = random_paged(seq_lens, kv_heads, head_dim, block_size)
    q = torch.randn(len(seq_lens), heads, head_dim)
    scale = head_dim**-0.5
    out = attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
    for i in range(len(seq_lens)):
        ref = dense_attention(q[i : i + 1], dense_k[i], dense_v[i], scale)
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("context", [0, 5, 16])
def test_torch_prefill_over_a_cached_prefix_matches_dense(context):
    block_size, heads, kv_heads, head_dim, n = 4, 4, 2, 64, 7
    total = context + n
    k_cache, v_cache, tables, dense_k, dense_v = random_paged([total], kv_heads, head_dim, block_size)
    q = torch.randn(n, heads, head_dim)
    out = attention.paged_prefill_attention(q, k_cache, v_cache, tables[0], context, head_dim**-0.5)
    ref = dense_attention(q, dense_k[0], dense_v[0], head_dim**-0.5, causal_offset=context)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_triton_kernels_under_the_interpreter():
    """The Triton cases run in a fresh process with TRITON_INTERPRET=1 set before triton is imported
    (the interpreter must be on when the kernels are decorated)."""
    cases = Path(__file__).with_name("triton_cases.py")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout
