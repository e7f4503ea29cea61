"""The engine's greedy output is token-for-token what transformers generates, and its logprobs are
within 1e-4, for every supported architecture, with prefix-cache hits, with 7-token prefill chunks, under
preemption, on both CPU attention backends and through the CUDA-graph path's buffers."""

from __future__ import annotations

import random

import pytest
import torch

from flotilla.engine.config import EngineConfig
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.llm_engine import LLMEngine

ATOL = 1e-4
MAX_TOKENS = 10
TOP = 3


def prompts(seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 258) for _ in range(shared_prefix)]
    lengths = [3, 17, 40, 9, 33, 1]
    return [[0] + prefix + [rng.randrange(2, 258) for _ in range(n)] for n in lengths]


def hf_reference(model, prompt_ids: list[int]):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=0,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    return tokens, logprobs


def make_engine(folder, **overrides) -> LLMEngine:
    options = dict(
        model=str(folder),
        device="cpu",
        dtype="float32",
        block_size=4,
        max_num_seqs=8,
        show_progress=False,
        kv_cache_memory=1 << 22,
    )
    options.update(overrides)
    return LLMEngine(EngineConfig(**options))  # type: ignore[arg-type]


def check_against_hf(engine: LLMEngine, model, batch: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    results = engine.generate(batch, params, use_tqdm=False)
    for prompt, result in zip(batch, results, strict=True):
        ref_tokens, ref_logprobs = hf_reference(model, prompt)
        assert result.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        assert result.finish_reason == "length"
        assert result.all_logprobs is not None and len(result.all_logprobs) == MAX_TOKENS
        worst = 0.0
        for step, (ours, ref) in enumerate(zip(result.all_logprobs, ref_logprobs, strict=True)):
            assert ours.token_id == ref_tokens[step]
            worst = max(worst, abs(ours.logprob - float(ref[ours.token_id])))
            for token, lp in ours.top:
                worst = max(worst, abs(lp - float(ref[token])))
            ref_top = ref.topk(TOP).indices.tolist()
            assert [t for t, _ in ours.top] == ref_top
        assert worst < ATOL, f"logprobs differ by {worst}"
    return results


@pytest.mark.parametrize("arch", ["llama-gqa", "llama-mqa-tied-headdim", "qwen2-bias-tied", "mistral"])
def test_greedy_matches_transformers(hf_models, arch):
    folder, model = hf_models(arch)
    engine = make_engine(folder)
    assert engine.runner.backend.name == "cpu"  # float32 on the CPU with a compiler: the compiled kernel
    check_against_hf(engine, model, prompts())


def test_the_torch_backend_matches_too(hf_models):
    """auto picks the compiled cpu kernel here; the torch path (the fallback without a compiler, and for
    other dtypes) must match as well."""
    folder, model = hf_models("llama-gqa")
    engine = make_engine(folder, attention_backend="torch")
    assert engine.runner.backend.name == "torch"
    check_against_hf(engine, model, prompts())


def test_matches_with_prefix_cache_hits(hf_models):
    folder, model = hf_models("qwen2-bias-tied")
    engine = make_engine(folder)
    batch = prompts(seed=1, shared_prefix=21)
    check_against_hf(engine, model, batch[:1])  # warms the cache with the shared prefix
    results = check_against_hf(engine, model, batch)
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0
    assert all(r.num_cached_tokens >= 20 for r in results)


def test_matches_with_seven_token_prefill_chunks(hf_models):
    folder, model = hf_models("llama-gqa")
    engine = make_engine(folder, max_num_batched_tokens=7)
    check_against_hf(engine, model, prompts(seed=2))


def test_matches_under_preemption(hf_models):
    folder, model = hf_models("llama-mqa-tied-headdim")
    cfg = model.config
    bytes_per_block = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 4
    # 16 blocks of 4 tokens: far less than the batch needs at once (it needs about 40).
    engine = make_engine(folder, kv_cache_memory=16 * bytes_per_block, enable_prefix_caching=False)
    assert engine.runner.num_blocks == 16
    check_against_hf(engine, model, prompts(seed=3))
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_matches_with_decode_steps_through_the_cuda_graph_buffers(hf_models, backend, monkeypatch):
    """What a CUDA graph replays, run eagerly (the capture itself needs a GPU): decode steps copied into
    static buffers and padded to a captured size (2 or 4 here), padding rows writing only the scratch
    block the block pool never hands out; a batch past the largest size runs without a graph."""
    folder, model = hf_models("llama-gqa")
    engine = make_engine(folder, attention_backend=backend, cuda_graph_sizes=[2, 4])
    runner = engine.runner
    assert runner.graphs is None  # never on the CPU unless asked for
    runner.enable_decode_graphs(capture=False)
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == [2, 4]
    batches: list[int] = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda rows: batches.append(len(rows)) or run(rows))
    scratch = runner.scratch_block
    assert scratch == runner.num_blocks == engine.kv_manager.num_blocks
    assert runner.kv_caches[0][0].shape[0] == runner.num_blocks + 1
    batch = prompts()
    check_against_hf(engine, model, batch[:3])  # 3 decoding: padded to 4
    check_against_hf(engine, model, batch[3:4])  # 1 decoding: padded to 2
    graphed = len(batches)
    check_against_hf(engine, model, batch)  # 6 decoding: past the largest graph, eager
    assert sorted(set(batches)) == [1, 3] and graphed == len(batches)
    assert runner.kv_caches[0][0][scratch].abs().sum() > 0  # the padding rows wrote there
