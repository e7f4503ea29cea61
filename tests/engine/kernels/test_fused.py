"""The C library's fused RMSNorm (with and without the residual add) and SiLU-and-mul against their torch
references: float32 to float32's precision, bfloat16 to at most one rounding (the sum of squares is added
in another order), over sizes with and without a tail past the last 8 values."""

from __future__ import annotations

import pytest
import torch

from flotilla.engine.kernels import attention, fused
from flotilla.engine.model import rope

pytestmark = pytest.mark.skipif(fused._functions(torch.float32) is None, reason="no C compiler here")


@pytest.fixture(autouse=True)
def fused_build(c_build_bf16_paths, monkeypatch):
    """Each test on the native build, on the one without AVX-512 and on the wide one without AVX512-BF16,
    whose roundings to bfloat16 are integer arithmetic where the native build's are the CPU's (conftest.py)."""
    c_build = c_build_bf16_paths
    if c_build is not None:

        def narrow(dtype):
            suffix = fused._SUFFIX[dtype]
            norm, silu = (
                getattr(c_build, f"flotilla_rms_norm_{suffix}"),
                getattr(c_build, f"flotilla_silu_and_mul_{suffix}"),
            )
            rope_store = getattr(c_build, f"flotilla_rope_store_{suffix}")
            norm.argtypes, silu.argtypes = fused.RMS_NORM_ARGS, fused.SILU_AND_MUL_ARGS
            rope_store.argtypes = fused.ROPE_STORE_ARGS
            return norm, silu, rope_store

        monkeypatch.setattr(fused, "_functions", narrow)


SIZES = [(1, 8), (5, 64), (7, 100), (48, 512), (3, 13)]
ULP = {torch.float32: 1e-6, torch.bfloat16: 2**-7}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=ULP[dtype], atol=ULP[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,d", SIZES)
def test_rms_norm_matches_the_reference(dtype, rows, d):
    gen = torch.Generator().manual_seed(rows * 1000 + d)
    x = (torch.randn(rows, d, generator=gen) * 3).to(dtype)
    w = torch.randn(d, generator=gen).to(dtype)
    with torch.inference_mode():
        close(fused.rms_norm(x, w, 1e-5), fused.rms_norm_reference(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,d", SIZES)
def test_add_rms_norm_returns_the_norm_of_the_sum_and_the_sum(dtype, rows, d):
    gen = torch.Generator().manual_seed(rows * 1000 + d + 1)
    x = torch.randn(rows, d, generator=gen).to(dtype)
    residual = torch.randn(rows, d, generator=gen).to(dtype)
    w = torch.randn(d, generator=gen).to(dtype)
    total = x + residual  # exactly what the torch path rounds
    want_norm, want_sum = fused.rms_norm_reference(total, w, 1e-6), total
    x_before = x.clone()
    with torch.inference_mode():
        got_norm, got_sum = fused.add_rms_norm(x, residual.clone(), w, 1e-6)
    assert torch.equal(got_sum, want_sum)  # the sum is rounded once, like torch's add
    close(got_norm, want_norm, dtype)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 29 = 16 + 8 + 5: the 16-lane, 8-lane and one-value loops of one row; 61 = 32 + 29: the two-vector loop too
@pytest.mark.parametrize("rows,inner", [(1, 8), (4, 1376), (9, 21), (48, 64), (3, 29), (2, 61)])
def test_silu_and_mul_matches_the_reference(dtype, rows, inner):
    gen = torch.Generator().manual_seed(rows * 1000 + inner)
    # Large magnitudes both ways: SiLU's sigmoid must hold for very negative and very positive gates.
    gate_up = (torch.randn(rows, 2 * inner, generator=gen) * 20).to(dtype)
    with torch.inference_mode():
        close(fused.silu_and_mul(gate_up), fused.silu_and_mul_reference(gate_up), dtype)


def test_the_torch_reference_serves_where_autograd_is_on():
    """A trainer shares RMSNorm: with gradients wanted, the C path (no backward) is never taken."""
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    out = fused.rms_norm(x, w, 1e-5)
    out.sum().backward()
    assert x.grad is not None and w.grad is not None


def rope_case(dtype, tokens, heads, kv_heads, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 4).to(dtype)
    cos, sin = rope.cos_sin_tables(head_dim, 512, 10000.0, None)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    rotation = cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)
    caches = [torch.full((6, 4, kv_heads, head_dim), 7.0, dtype=dtype) for _ in range(2)]
    slots = torch.randperm(24, generator=gen)[:tokens]
    return qkv, rotation, caches, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 4, 2, 64), (9, 8, 8, 16), (5, 6, 2, 128)])
def test_rope_and_store_rounds_as_the_torch_rotation_bit_for_bit(dtype, tokens, heads, kv_heads, head_dim):
    qkv, rotation, (k_cache, v_cache), slots = rope_case(dtype, tokens, heads, kv_heads, head_dim, tokens)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qk = rope.rotate(qkv[:, : q_size + kv_size].view(tokens, heads + kv_heads, head_dim), rotation)
    want_q, k = qk.split([heads, kv_heads], dim=1)
    attention.store_kv(k, qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim), want_k, want_v, slots)
    with torch.inference_mode():
        got_q = fused.rope_and_store(qkv, rotation, k_cache, v_cache, slots, heads, kv_heads)
    assert got_q is not None
    assert torch.equal(got_q, want_q)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # and no other slot touched


def test_rope_and_store_declines_what_it_does_not_handle_and_writes_nothing():
    qkv, rotation, (k_cache, v_cache), slots = rope_case(torch.float32, 3, 2, 2, 8, 0)
    before = k_cache.clone()
    with torch.inference_mode():
        assert fused.rope_and_store(qkv, rotation, k_cache, v_cache, slots, 2, 2) is None  # head_dim 8
        qkv, rotation, (k_cache, v_cache), slots = rope_case(torch.float16, 3, 2, 2, 16, 0)
        assert fused.rope_and_store(qkv, rotation, k_cache, v_cache, slots, 2, 2) is None  # float16
        qkv, rotation, (k_cache, v_cache), slots = rope_case(torch.float32, 3, 2, 2, 16, 0)
        assert fused.rope_and_store(qkv, rotation, k_cache, v_cache, slots.int(), 2, 2) is None
    assert fused.rope_and_store(qkv, rotation, k_cache, v_cache, slots, 2, 2) is None  # autograd on
    assert torch.equal(before, torch.full_like(before, 7.0))


def test_bfloat16_results_below_the_smallest_normal_differ_from_torch_by_less_than_it():
    """Where the CPU rounds to bfloat16 itself (vcvtneps2bf16, AVX512-BF16), a float32 subnormal becomes 0;
    torch keeps a bfloat16 subnormal. Products of SiLU and a subnormal `up` land there: no more than 2^-126
    apart, on every build, and every normal value as before."""
    rows, inner = 2, 40
    gate = torch.linspace(0.5, 4.0, rows * inner).reshape(rows, inner)
    up = torch.full((rows, inner), 3e-39)  # a float32 subnormal; bfloat16 has the same exponent range
    up[:, ::2] = 1.5  # and normal products beside them
    gate_up = torch.cat([gate, up], dim=1).bfloat16()
    with torch.inference_mode():
        got, want = fused.silu_and_mul(gate_up), fused.silu_and_mul_reference(gate_up)
    assert bool((want[:, 1::2] != 0).any()), (
        "the reference must keep some subnormals for this to test anything"
    )
    assert torch.equal(got[:, ::2], want[:, ::2])
    assert float((got[:, 1::2].float() - want[:, 1::2].float()).abs().max()) < 2.0**-126
