"""Paged attention: the torch reference and the CPU's compiled decode and prefill kernels against plain dense attention,
and the Triton kernels (run by Triton's CPU interpreter, TRITON_INTERPRET=1) against the reference, over
block sizes, GQA ratios, head dims 64 and 128, and ragged lengths."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flotilla.engine.kernels import attention, c_library, cpu_attention, cpu_decode, cpu_prefill


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


CPU_KERNEL_CASES = [
    # block_size, num_heads, num_kv_heads, head_dim, seq_lens
    (16, 8, 8, 64, [1, 16, 17, 40]),
    (16, 8, 2, 64, [5, 33, 64, 2]),
    (8, 8, 1, 128, [9, 1, 30]),
    (32, 4, 2, 128, [70, 31, 3]),
    (4, 12, 4, 64, [3, 4, 5, 13]),
    (64, 16, 1, 128, [200, 1, 64, 65]),
    (1, 2, 2, 8, [1, 7]),
    (16, 6, 2, 96, [50, 16, 1]),  # the wide path with a head_dim it has no constant copy for
    (16, 4, 4, 80, [23, 40]),  # a multiple of 16, not of 32: the narrow path everywhere
    # Enough requests that work items are whole requests, each prefetching the next one's first blocks.
    (16, 8, 4, 64, [1, 17, 40, 3, 16, 33, 64, 2, 5, 90, 31, 7]),
]


def _use_build(module, c_build, monkeypatch) -> None:
    """Points `module.kernel` (cpu_decode's or cpu_prefill's) at the build c_build names (None: native)."""
    if c_build is not None:

        def narrow(dtype):
            fn = getattr(c_build, module.SYMBOLS[dtype])
            fn.argtypes, fn.restype = module._ARGS, module.ctypes.c_int32
            return fn

        monkeypatch.setattr(module, "kernel", narrow)


@pytest.fixture
def kernel_build(c_build, monkeypatch):
    """The decode kernel of the native build, or of the build without AVX-512 (conftest.py)."""
    _use_build(cpu_decode, c_build, monkeypatch)


def test_the_wide_path_is_built_where_avx512_with_bfloat16_is_and_only_there(c_build):
    flags = set(c_library._cpu_features().split())
    if c_build is None:
        assert cpu_decode.vector_lanes() == (16 if {"avx512f", "avx512_bf16"} <= flags else 8)
    else:
        assert c_build.flotilla_paged_decode_lanes() == 8


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,seq_lens", CPU_KERNEL_CASES)
@pytest.mark.parametrize("magnitude", [1.0, 40.0])
def test_cpu_kernel_matches_dense_attention(
    kernel_build, block_size, heads, kv_heads, head_dim, seq_lens, magnitude
):
    """magnitude 40 makes one score dominate each row: the online softmax must rescale across blocks."""
    k_cache, v_cache, tables, dense_k, dense_v = random_paged(
        seq_lens, kv_heads, head_dim, block_size, seed=3
    )
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(4)) * magnitude
    scale = head_dim**-0.5
    out = cpu_decode.paged_decode(
        q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), scale
    )
    for i in range(len(seq_lens)):
        ref = dense_attention(q[i : i + 1], dense_k[i], dense_v[i], scale)
        torch.testing.assert_close(out[i : i + 1], ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,seq_lens", CPU_KERNEL_CASES)
@pytest.mark.parametrize("magnitude", [1.0, 40.0])
def test_cpu_kernel_over_bfloat16_caches_matches_float32_attention_over_the_same_values(
    kernel_build, block_size, heads, kv_heads, head_dim, seq_lens, magnitude
):
    """bfloat16 caches and queries: the kernel widens each value exactly and adds in float32, so the only
    difference from float32 attention over the same (bfloat16) values is the output's rounding."""
    k_cache, v_cache, tables, dense_k, dense_v = random_paged(
        seq_lens, kv_heads, head_dim, block_size, seed=5
    )
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(6)) * magnitude
    q = q.bfloat16()
    scale = head_dim**-0.5
    out = cpu_decode.paged_decode(
        q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), scale
    )
    assert out.dtype == torch.bfloat16
    for i in range(len(seq_lens)):
        k, v = dense_k[i].bfloat16().float(), dense_v[i].bfloat16().float()
        ref = dense_attention(q[i : i + 1].float(), k, v, scale)
        # One rounding to bfloat16 (8 bits of mantissa) is all that separates them.
        torch.testing.assert_close(out[i : i + 1].float(), ref, atol=1e-5, rtol=2**-8)


def test_cpu_kernel_reads_block_table_rows_with_a_stride_and_leaves_the_caches_alone(kernel_build):
    """Rows of a wider table (the engine's padded block tables) and an empty batch."""
    k_cache, v_cache, tables, dense_k, dense_v = random_paged([20, 9], 2, 64, 8, seed=5)
    wide = torch.zeros(2, tables.shape[1] + 5, dtype=torch.int32)
    wide[:, : tables.shape[1]] = tables
    before = k_cache.clone(), v_cache.clone()
    q = torch.randn(2, 4, 64)
    out = cpu_decode.paged_decode(q, k_cache, v_cache, wide, torch.tensor([20, 9], dtype=torch.int32), 0.125)
    for i in range(2):
        torch.testing.assert_close(
            out[i : i + 1], dense_attention(q[i : i + 1], dense_k[i], dense_v[i], 0.125)
        )
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    empty = cpu_decode.paged_decode(
        q[:0], k_cache, v_cache, wide[:0], torch.zeros(0, dtype=torch.int32), 0.125
    )
    assert empty.shape == (0, 4, 64)


PREFILL_CASES = [
    # block_size, num_heads, num_kv_heads, head_dim, [(context, new tokens) per chunk]
    (16, 8, 4, 64, [(0, 40), (0, 1), (0, 17)]),  # tiny-llama's shapes; tiles of 32 tokens, partial ones
    (16, 8, 8, 64, [(5, 30), (16, 16), (0, 3)]),  # a cached prefix, aligned to blocks and not
    (8, 8, 1, 128, [(21, 9), (0, 70)]),  # 8 query heads per KV head: tiles of 8 tokens
    (32, 4, 2, 128, [(0, 100), (33, 2)]),  # a chunk of two tokens: speculative verification's shape
    (4, 12, 4, 32, [(3, 13), (0, 5)]),  # 3 heads per KV head; head_dim 32: two 16-float vectors
    (64, 16, 1, 64, [(64, 65)]),  # 16 heads per KV head: 4 tokens a tile
    (16, 6, 2, 96, [(7, 25)]),
]


@pytest.fixture
def prefill_build(c_build_bf16_paths, monkeypatch):
    """The prefill kernel of the native build, of the build without AVX-512, or of the wide build without
    AVX512-BF16 (conftest.py)."""
    c_build = c_build_bf16_paths
    _use_build(cpu_prefill, c_build, monkeypatch)
    if c_build is not None:
        monkeypatch.setattr(cpu_prefill, "vector_lanes", c_build.flotilla_paged_prefill_lanes)
        monkeypatch.setattr(cpu_prefill, "unusable", cpu_prefill.unusable.__wrapped__)
        monkeypatch.setattr(
            cpu_prefill, "rounds_weights", lambda d: bool(c_build.flotilla_paged_prefill_rounds_weights(d))
        )


def _prefill_case(block_size, heads, kv_heads, head_dim, chunks, dtype, magnitude, seed):
    """Caches holding each chunk's context and itself, the chunks' rows behind `lead` decode-like rows the
    kernel must leave alone, and the dense reference of each chunk: its output, and the weighted mean of
    the values' magnitudes (what rounding the weights can move the output by, relative to it)."""
    totals = [context + n for context, n in chunks]
    k_cache, v_cache, tables, dense_k, dense_v = random_paged(
        totals, kv_heads, head_dim, block_size, seed=seed
    )
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    lead = 2
    rows = sum(n for _, n in chunks) + lead
    q = (
        torch.randn(rows, heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)) * magnitude
    ).to(dtype)
    starts = [lead + sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    plan = cpu_prefill.PrefillPlan.of(tables, starts, [n for _, n in chunks], [c for c, _ in chunks])
    refs = []
    for i, (context, n) in enumerate(chunks):
        k, v = dense_k[i].to(dtype).float(), dense_v[i].to(dtype).float()
        rows_q = q[starts[i] : starts[i] + n].float()
        refs.append(
            tuple(dense_attention(rows_q, k, x, head_dim**-0.5, causal_offset=context) for x in (v, v.abs()))
        )
    return q, k_cache, v_cache, plan, starts, refs


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim,chunks", PREFILL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1.0, 40.0])
def test_cpu_prefill_kernel_matches_dense_causal_attention(
    prefill_build, block_size, heads, kv_heads, head_dim, chunks, dtype, magnitude
):
    """Each chunk attends to its context and causally to itself; magnitude 40 makes one score dominate a row,
    so the online softmax must rescale across sub-tiles. In bfloat16 the differences from float32
    attention over the same values are the output's one rounding and, where the build rounds them, the
    weights' roundings to bfloat16: each moves a weight by at most 2**-8 of itself (bfloat16's unit
    roundoff), so the output by at most 2**-8 of the weighted mean of the values' magnitudes."""
    if cpu_prefill.unusable(dtype, head_dim, heads, kv_heads):
        pytest.skip(cpu_prefill.unusable(dtype, head_dim, heads, kv_heads))
    q, k_cache, v_cache, plan, starts, refs = _prefill_case(
        block_size, heads, kv_heads, head_dim, chunks, dtype, magnitude, seed=11
    )
    caches_before = k_cache.clone(), v_cache.clone()
    out = torch.full_like(q, 7.0)
    cpu_prefill.paged_prefill(q, k_cache, v_cache, plan, head_dim**-0.5, out)
    tolerance = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-5, "rtol": 2**-8}
    rounded_weights = dtype == torch.bfloat16 and cpu_prefill.rounds_weights(head_dim)
    for (_, n), start, (ref, magnitudes) in zip(chunks, starts, refs, strict=True):
        got = out[start : start + n].float()
        if rounded_weights:
            bound = 2**-8 * (magnitudes + ref.abs()) + 1e-5
            assert bool(((got - ref).abs() <= bound).all()), float(((got - ref).abs() / bound).max())
        else:
            torch.testing.assert_close(got, ref, **tolerance)
    assert bool((out[:2] == 7.0).all()), "rows outside the chunks were written"
    assert torch.equal(k_cache, caches_before[0]) and torch.equal(v_cache, caches_before[1])


def test_the_prefill_kernel_refuses_an_output_it_cannot_write_and_writes_nothing():
    q, k_cache, v_cache, plan, _, _ = _prefill_case(16, 8, 4, 64, [(0, 5)], torch.float32, 1.0, seed=3)
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out is torch.bfloat16, the caches torch.float32"):
        cpu_prefill.paged_prefill(q, k_cache, v_cache, plan, 0.125, out)
    strided = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2])[..., ::2]
    with pytest.raises(ValueError, match="must be contiguous"):
        cpu_prefill.paged_prefill(q, k_cache, v_cache, plan, 0.125, strided)
    assert not out.any() and not strided.any()


def test_the_prefill_kernel_names_the_sizes_it_does_not_serve(prefill_build):
    lanes = cpu_prefill.vector_lanes()
    assert cpu_prefill.unusable(torch.float32, 64, 8, 4) is None
    assert cpu_prefill.unusable(torch.float32, lanes + 4, 8, 4) == (
        f"head_dim {lanes + 4}: it handles multiples of {lanes} up to 256"
    )
    assert cpu_prefill.unusable(torch.float32, 512, 8, 4).startswith("head_dim 512")
    assert cpu_prefill.unusable(torch.float32, 64, 128, 1).startswith("128 heads over 1 KV heads")
    assert cpu_prefill.unusable(torch.float16, 64, 8, 4).endswith("the dtype is float16")


@pytest.mark.parametrize("head_dim", [64, 24])
def test_the_cpu_backend_matches_the_torch_backend_over_a_mixed_step(head_dim):
    """Decode requests and a prefill chunk in one step: the cpu backend decodes with the decode kernel and
    the chunk with the prefill kernel (head_dim 24 on a machine with AVX-512: with the torch path, which it
    falls back to), and both land in the right rows."""
    block_size, heads, kv_heads = 4, 8, 2
    seq_lens = [9, 6, 13]  # request 1 is a 3-token chunk after 3 cached tokens
    k_cache, v_cache, tables, _, _ = random_paged(seq_lens, kv_heads, head_dim, block_size, seed=7)
    new = [1, 3, 1]
    starts = [0, 1, 4, 5]
    meta = attention.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        query_start=starts,
        context_lens=[s - n for s, n in zip(seq_lens, new, strict=True)],
        seq_lens=seq_lens,
        block_tables=tables,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        decode_requests=[0, 2],
        prefill_requests=[1],
        decode_token_index=torch.tensor([0, 4]),
    )
    q = torch.randn(5, heads, head_dim)
    ref = attention.TorchAttentionBackend().attend(q, k_cache, v_cache, meta, 0.125)
    meta.backend_cache.clear()
    got = cpu_attention.CpuAttentionBackend().attend(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


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
