"""Paged attention: the torch reference against plain dense attention, and the Triton kernels (run by
Triton's CPU interpreter, TRITON_INTERPRET=1) against the reference, over block sizes, GQA ratios,
head dims 64 and 128, and ragged lengths."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
from flotilla.engine import attention


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


@pytest.fixture(scope="module")
def triton_kernels():
    """The kernel module, (re)imported with the interpreter on, so it runs on CPU tensors."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    name = "flotilla.engine.triton_attention"
    module = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    yield module
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,seq_lens", SHAPES)
def test_triton_decode_matches_reference(triton_kernels, block_size, heads, kv_heads, head_dim, seq_lens):
    k_cache, v_cache, tables, _, _ = random_paged(seq_lens, kv_heads, head_dim, block_size, seed=1)
    q = torch.randn(len(seq_lens), heads, head_dim)
    scale = head_dim**-0.5
    ref = attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
    out = triton_kernels.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), scale
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (1, 128, 8), (4, 64, 4)])
def test_triton_kv_store_matches_reference(triton_kernels, num_kv_heads, head_dim, block_size):
    num_blocks, tokens = 6, 11
    gen = torch.Generator().manual_seed(2)
    # K/V as views into a fused qkv output, like the model passes them.
    qkv = torch.randn(tokens, (2 + 2 * num_kv_heads) * head_dim, generator=gen)
    key = qkv[:, 2 * head_dim : (2 + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    value = qkv[:, (2 + num_kv_heads) * head_dim :].view(tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    ref_k, ref_v = torch.zeros(shape), torch.zeros(shape)
    attention.store_kv(key, value, ref_k, ref_v, slots)
    out_k, out_v = torch.zeros(shape), torch.zeros(shape)
    triton_kernels.store_kv(key, value, out_k, out_v, slots)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)


def test_engine_with_the_triton_backend_matches_the_torch_backend(triton_kernels, hf_models):
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.llm_engine import LLMEngine
    from flotilla.engine.sampling_params import SamplingParams

    folder, _ = hf_models("qwen2-bias-tied")
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    prompts = [[0, 5, 9, 200, 7], [0, 3], list(range(2, 30))]
    results = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(
            EngineConfig(model=str(folder), device="cpu", dtype="float32", block_size=4, attention_backend=backend,
                         kv_cache_memory=1 << 20, show_progress=False)
        )  # fmt: skip
        assert engine.runner.backend.name == backend
        results[backend] = engine.generate(prompts, params, use_tqdm=False)
    for a, b in zip(results["torch"], results["triton"], strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.all_logprobs, b.all_logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < 1e-4
