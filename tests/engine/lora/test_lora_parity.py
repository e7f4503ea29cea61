"""Batched multi-LoRA against PEFT: one engine serves the base model and three adapters mixed in the same
batch (prefill chunks and decodes), and each request's greedy tokens are what transformers generates with
its own adapter applied by PEFT (the base: no adapter), logprobs within 1e-4, with prefix-cache hits,
7-token prefill chunks and preemption, on every architecture."""

from __future__ import annotations

import pytest

from flotilla.engine.core.sampling_params import SamplingParams

from ..test_hf_parity import ATOL, MAX_TOKENS, TOP, hf_reference, make_engine, prompts


def run_mixed(engine, batch, names):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    ids = [engine.add_request(p, params, lora_name=n).request_id for p, n in zip(batch, names, strict=True)]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[i] for i in ids]


def check(results, batch, names, references):
    for prompt, name, result in zip(batch, names, results, strict=True):
        ref_tokens, ref_logprobs = hf_reference(references[name], prompt)
        assert result.token_ids == ref_tokens, f"{name or 'base'}: prompt of {len(prompt)} tokens diverged"
        assert result.all_logprobs is not None
        worst = max(
            abs(ours.logprob - float(ref[ours.token_id]))
            for ours, ref in zip(result.all_logprobs, ref_logprobs, strict=True)
        )
        assert worst < ATOL, f"{name or 'base'}: logprobs differ by {worst}"


def mixed_batch(adapters):
    """Every prompt once per adapter and once for the base, interleaved: the same prompt with different
    adapters must give different KV (no prefix sharing across adapters)."""
    names = [None, *adapters]
    batch, who = [], []
    for prompt in prompts(seed=3, shared_prefix=12)[:4]:
        for name in names:
            batch.append(prompt)
            who.append(name)
    return batch, who


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2-bias-tied", "mistral"])
def test_a_mixed_batch_of_base_and_three_adapters_matches_peft(hf_models, lora_adapters, arch):
    folder, base = hf_models(arch)
    adapters = lora_adapters(arch)
    engine = make_engine(
        folder,
        enable_lora=True,
        lora_modules={name: str(path) for name, (path, _ref) in adapters.items()},
        max_loras=3,
        max_lora_rank=16,
        max_num_seqs=16,
    )
    references = {None: base, **{name: ref for name, (_path, ref) in adapters.items()}}
    batch, who = mixed_batch(adapters)
    results = run_mixed(engine, batch, who)
    check(results, batch, who, references)
    # The adapters matter: each changes some prompt's tokens (else the parity above would prove nothing).
    by_name: dict = {}
    for prompt, name, result in zip(batch, who, results, strict=True):
        by_name.setdefault(name, []).append((tuple(prompt), result.token_ids))
    for name in adapters:
        assert by_name[name] != by_name[None], f"{name} generates what the base model does"
    # Again: now every prompt's blocks are in the prefix cache, each under its own adapter.
    before = engine.kv_manager.prefix_cache_hits
    check(run_mixed(engine, batch, who), batch, who, references)
    assert engine.kv_manager.prefix_cache_hits > before


@pytest.mark.parametrize(
    ("case", "overrides"),
    [
        # 7-token prefill chunks, and 2 slots for 3 adapters: requests wait for a slot.
        ("chunks", {"max_num_batched_tokens": 7}),
        # 16 blocks of 4 tokens, far less than the batch needs at once: requests are preempted.
        ("preemption", {"kv_blocks": 16, "enable_prefix_caching": False}),
    ],
)
def test_fewer_slots_than_adapters_with_chunks_or_preemption_keep_parity(
    hf_models, lora_adapters, case, overrides
):
    folder, base = hf_models("llama-gqa")
    adapters = lora_adapters("llama-gqa")
    overrides = dict(overrides)
    if "kv_blocks" in overrides:
        overrides["kv_cache_memory"] = overrides.pop("kv_blocks") * kv_bytes_per_block(folder)
    engine = make_engine(
        folder,
        enable_lora=True,
        lora_modules={name: str(path) for name, (path, _ref) in adapters.items()},
        max_loras=2,
        max_lora_rank=16,
        **overrides,
    )
    references = {None: base, **{name: ref for name, (_path, ref) in adapters.items()}}
    batch, who = mixed_batch(adapters)
    check(run_mixed(engine, batch, who), batch, who, references)
    if case == "preemption":
        assert engine.scheduler.num_preemptions > 0
    pool, slots = engine.kv_manager.pool, engine.scheduler.lora_slots
    assert pool.num_free_blocks == engine.kv_manager.num_blocks
    assert slots is not None and not any(slots.users)


def kv_bytes_per_block(folder) -> int:
    """Bytes one KV block of 4 tokens takes in float32, for a KV budget counted in blocks."""
    from flotilla.engine.model.config import ModelConfig

    return ModelConfig.from_file(folder / "config.json").kv_bytes_per_token(4) * 4


def test_ngram_speculation_with_adapters_keeps_parity(hf_models, lora_adapters):
    """Drafts are verified by the target with each request's own adapter, so speculation changes no token."""
    folder, base = hf_models("llama-gqa")
    adapters = lora_adapters("llama-gqa")
    engine = make_engine(
        folder,
        enable_lora=True,
        lora_modules={name: str(path) for name, (path, _ref) in adapters.items()},
        max_loras=3,
        max_lora_rank=16,
        speculative_method="ngram",
        num_speculative_tokens=3,
        speculative_max_batch_size=16,
    )
    references = {None: base, **{name: ref for name, (_path, ref) in adapters.items()}}
    batch, who = mixed_batch(adapters)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params, lora_name=n).request_id for p, n in zip(batch, who, strict=True)]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    for prompt, name, rid in zip(batch, who, ids, strict=True):
        assert finals[rid].token_ids == hf_reference(references[name], prompt)[0], name
    assert engine.spec_stats.num_draft_tokens > 0  # it did speculate


def test_quantization_with_adapters_is_refused_by_name(hf_models):
    folder, _base = hf_models("llama-gqa")
    with pytest.raises(ValueError, match="--quantization int8 with --enable-lora"):
        make_engine(folder, enable_lora=True, quantization="int8")
