"""Triton kernels against the torch reference, on the CPU through Triton's interpreter. Run by
test_attention.py in a process started with TRITON_INTERPRET=1; not collected on its own."""

from __future__ import annotations

import os

import pytest
import torch

from flotilla.engine.kernels import attention

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

from flotilla.engine.kernels import triton_attention as triton_kernels  # noqa: E402


def _load_sibling(name: str):
    # Tests are imported by path (--import-mode=importlib), so the sibling is loaded the same way.
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_reference = _load_sibling("test_attention")
SHAPES, random_paged = _reference.SHAPES, _reference.random_paged


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,seq_lens", SHAPES)
def test_triton_decode_matches_reference(block_size, heads, kv_heads, head_dim, seq_lens):
    k_cache, v_cache, tables, _, _ = random_paged(seq_lens, kv_heads, head_dim, block_size, seed=1)
    q = torch.randn(len(seq_lens), heads, head_dim)
    scale = head_dim**-0.5
    ref = attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
    out = triton_kernels.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), scale
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _decode_case(block_size, group, head_dim, seq_lens, num_splits=None, dtype=torch.float32, kv_heads=2):
    k_cache, v_cache, tables, _, _ = random_paged(seq_lens, kv_heads, head_dim, block_size, seed=3)
    q = torch.randn(len(seq_lens), group * kv_heads, head_dim, generator=torch.Generator().manual_seed(4))
    k_cache, v_cache, q = k_cache.to(dtype), v_cache.to(dtype), q.to(dtype)
    scale = head_dim**-0.5
    # The reference in fp32 over the same (rounded) inputs.
    k32, v32 = k_cache.float(), v_cache.float()
    ref = attention.paged_decode_attention(q.float(), k32, v32, tables, seq_lens, scale)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    if num_splits is None:
        out = triton_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    else:
        out = triton_kernels._decode(q, k_cache, v_cache, tables, lens, scale, max(seq_lens), num_splits)
    assert out.dtype == dtype and out.shape == q.shape
    return out.float(), ref


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_grouped_split_decode_matches_reference(block_size, group, head_dim):
    # Ragged: one token, a block boundary, one past it, and a request that spans all three splits (the
    # short ones leave later splits empty).
    seq_lens = [1, block_size, block_size + 1, 5 * block_size + 3]
    out, ref = _decode_case(block_size, group, head_dim, seq_lens, num_splits=3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size,group,head_dim,seq_lens", [
    (16, 4, 64, [1, 530, 1100, 17]),  # decode_splits picks 4
    (32, 8, 128, [600, 1, 33]),  # 2
    (16, 2, 64, [1, 16, 17, 40]),  # 1: written straight to the output
])  # fmt: skip
def test_decode_with_the_chosen_splits_matches_reference(block_size, group, head_dim, seq_lens):
    out, ref = _decode_case(block_size, group, head_dim, seq_lens)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size,num_splits", [(4, 3), (8, 2)])
def test_blocks_smaller_than_a_tile_split_decode_matches_reference(block_size, num_splits):
    # Tiles are 16 tokens, so one tile reads several blocks through the block table.
    out, ref = _decode_case(block_size, 2, 64, [1, block_size, block_size + 1, 61], num_splits=num_splits)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# fp16 only: the interpreter (Triton 3.9) runs tl.dot on bfloat16 over the raw uint16 bits, so bf16
# cannot be checked on the CPU.
@pytest.mark.parametrize("head_dim,num_splits", [(64, 1), (128, 3)])
def test_fp16_decode_matches_reference(head_dim, num_splits):
    out, ref = _decode_case(16, 4, head_dim, [1, 16, 17, 83], num_splits=num_splits, dtype=torch.float16)
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)


def test_decode_splits():
    split = triton_kernels.decode_splits
    # Short contexts: one split.
    assert [split(n, 16) for n in (1, 16, 256, 496)] == [1] * 4
    # Each split covers at least 256 tokens (16 blocks of 16; a partial last block counts) ...
    assert [split(n, 16) for n in (497, 752, 753, 1100)] == [2, 2, 3, 4]
    # ... and at least 4 blocks when blocks are large.
    assert [split(n, 128) for n in (511, 512, 1024)] == [1, 1, 2]
    # Capped.
    assert split(1 << 20, 16) == triton_kernels.MAX_SPLITS


def _prefill_case(block_size, group, head_dim, dtype=torch.float32, kv_heads=2):
    # Ragged (context, new tokens) per request: a fresh prompt over several query tiles, a chunk after a
    # prefix that ends mid-block, a prefix-cache hit (whole blocks) with a few new tokens, one new token.
    chunks = [(0, 70), (block_size + 5, 20), (2 * block_size, 3), (11, 1)]
    seq_lens = [c + n for c, n in chunks]
    k_cache, v_cache, tables, _, _ = random_paged(seq_lens, kv_heads, head_dim, block_size, seed=5)
    num_tokens = sum(n for _, n in chunks)
    q = torch.randn(num_tokens, group * kv_heads, head_dim, generator=torch.Generator().manual_seed(6))
    k_cache, v_cache, q = k_cache.to(dtype), v_cache.to(dtype), q.to(dtype)
    scale = head_dim**-0.5
    query_start = [0]
    for _, n in chunks:
        query_start.append(query_start[-1] + n)
    # The reference in fp32 over the same (rounded) inputs, one request at a time.
    k32, v32, q32 = k_cache.float(), v_cache.float(), q.float()
    ref = torch.cat([
        attention.paged_prefill_attention(q32[query_start[r] : query_start[r + 1]], k32, v32, tables[r], c, scale)
        for r, (c, _) in enumerate(chunks)
    ])  # fmt: skip
    block_m = triton_kernels.prefill_block_m(group)
    tiles = triton_kernels.prefill_tiles(
        query_start, [c for c, _ in chunks], range(len(chunks)), block_m, "cpu"
    )
    out = triton_kernels.paged_prefill_attention(q, k_cache, v_cache, tables, tiles, scale)
    assert out.dtype == dtype and out.shape == q.shape
    return out.float(), ref


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_prefill_matches_reference(block_size, group, head_dim):
    out, ref = _prefill_case(block_size, group, head_dim)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size,group", [(4, 2), (8, 8)])
def test_prefill_with_blocks_smaller_than_a_tile_matches_reference(block_size, group):
    # One KV tile reads several blocks through the block table (the engine-parity test runs blocks of 4).
    out, ref = _prefill_case(block_size, group, 64)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fp16_prefill_matches_reference():
    out, ref = _prefill_case(16, 4, 64, dtype=torch.float16)
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)


def test_prefill_tiles():
    # Requests 0 and 2 prefill (1 decodes): tiles of 4 tokens, positions after each context.
    tiles = triton_kernels.prefill_tiles([0, 6, 7, 10], [0, 9, 5], [0, 2], 4, "cpu")
    assert tiles.tolist() == [[0, 0, 4, 0], [0, 4, 2, 4], [2, 7, 3, 5]]
    assert triton_kernels.prefill_block_m(1) == 64 and triton_kernels.prefill_block_m(3) == 16


@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (1, 128, 8), (4, 64, 4)])
def test_triton_kv_store_matches_reference(num_kv_heads, head_dim, block_size):
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


def test_engine_with_the_triton_backend_matches_the_torch_backend(hf_models):
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.core.sampling_params import SamplingParams
    from flotilla.engine.llm_engine import LLMEngine

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_lora_matches_the_reference(dtype):
    """Segments of several lengths (one past a tile, one row) over slots of different widths, a base
    segment left alone, and output widths past one column tile."""
    from flotilla.engine.kernels import lora, triton_lora

    torch.manual_seed(0)
    slots, max_width, k, n = 3, 24, 80, 150
    a = torch.randn(slots, max_width, k).to(dtype)
    bt = torch.randn(slots, max_width, n).to(dtype)
    widths = [24, 8, 0]
    x = torch.randn(40, k).to(dtype)
    out = torch.randn(40, n).to(dtype)
    segments = [(0, 19, 1), (19, 20, 0), (25, 40, 2), (20, 25, 0)]
    ref = lora.reference_add_lora(out, x, a, bt, widths, segments)
    table, longest = triton_lora.segment_table(segments, x.device)
    got = triton_lora.triton_add_lora(
        out.clone(), x, a, bt, torch.tensor(widths, dtype=torch.int32), table, longest
    )
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tolerance * 10, rtol=tolerance)
    torch_path = lora.add_lora(out.clone(), x, a, bt, widths, segments)
    torch.testing.assert_close(torch_path.float(), ref.float(), atol=tolerance * 10, rtol=tolerance)
