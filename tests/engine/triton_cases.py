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
