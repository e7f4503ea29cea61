"""Speculative decoding is lossless: greedy output with n-gram or draft-model speculation is token for
token what transformers generates (and what the engine gives without it), for every architecture, with
prefill chunks, prefix-cache hits, preemption and aborts; sampled output follows the plain engine's
distribution; stop strings and opted-out requests behave as without speculation."""

from __future__ import annotations

import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.llm_engine import LLMEngine

from .test_hf_parity import MAX_TOKENS, hf_reference, make_engine, prompts

ARCHS = ["llama-gqa", "llama-mqa-tied-headdim", "qwen2-bias-tied", "mistral"]


@pytest.fixture(scope="session")
def draft_of(hf_models, tmp_path_factory):
    """arch -> a draft model folder: the target's weights plus noise, so that the draft agrees with the
    target often but not always (both acceptance and rejection happen)."""
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            folder, _model = hf_models(arch)
            draft = tmp_path_factory.mktemp(f"{arch}-draft")
            for path in folder.iterdir():
                if path.suffix != ".safetensors":
                    shutil.copy(path, draft / path.name)
            gen = torch.Generator().manual_seed(7)
            for path in folder.glob("*.safetensors"):
                weights = load_file(path)
                noisy = {
                    name: w + 0.08 * w.std() * torch.randn(w.shape, generator=gen)
                    for name, w in weights.items()
                }
                save_file(noisy, draft / path.name, metadata={"format": "pt"})
            cache[arch] = draft
        return cache[arch]

    return get


def speculative_engine(folder, method: str, draft: Path | None = None, **overrides) -> LLMEngine:
    options = dict(speculative_method=method, num_speculative_tokens=3, speculative_max_batch_size=8)
    if method == "draft":
        options["speculative_model"] = str(draft)
    return make_engine(folder, **(options | overrides))


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def check_greedy_against_hf(engine: LLMEngine, model, batch: list[list[int]]) -> None:
    results = engine.generate(batch, greedy(), use_tqdm=False)
    for prompt, result in zip(batch, results, strict=True):
        ref_tokens, _ = hf_reference(model, prompt)
        assert result.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        assert result.finish_reason == "length"


def assert_no_blocks_held(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.owned_blocks() == {}
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_speculation_matches_transformers(hf_models, draft_of, arch, method):
    folder, model = hf_models(arch)
    engine = speculative_engine(folder, method, draft_of(arch))
    check_greedy_against_hf(engine, model, prompts())
    spec = engine.stats().spec_decode
    assert spec.num_drafts > 0 and spec.num_draft_tokens > 0
    if method == "draft":
        # Both paths ran: some drafts accepted, some rejected.
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert_no_blocks_held(engine)


def test_ngram_drafts_are_accepted_where_the_output_repeats(hf_models):
    """Random tiny models fall into loops under greedy decoding; there the n-gram drafts are right."""
    folder, model = hf_models("llama-gqa")
    engine = speculative_engine(folder, "ngram")
    batch = prompts(seed=5)
    results = engine.generate(batch, greedy(40), use_tqdm=False)
    for prompt, result in zip(batch, results, strict=True):
        assert result.token_ids == engine_without_speculation(folder, prompt, 40)
    assert engine.stats().spec_decode.num_accepted_tokens > 0


def engine_without_speculation(folder, prompt, max_tokens) -> list[int]:
    (result,) = make_engine(folder).generate([prompt], greedy(max_tokens), use_tqdm=False)
    assert result.token_ids is not None
    return result.token_ids


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_matches_with_seven_token_prefill_chunks(hf_models, draft_of, method):
    folder, model = hf_models("llama-gqa")
    engine = speculative_engine(folder, method, draft_of("llama-gqa"), max_num_batched_tokens=7)
    check_greedy_against_hf(engine, model, prompts(seed=2))
    assert engine.stats().spec_decode.num_drafts > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_matches_with_prefix_cache_hits(hf_models, draft_of, method):
    folder, model = hf_models("qwen2-bias-tied")
    engine = speculative_engine(folder, method, draft_of("qwen2-bias-tied"))
    batch = prompts(seed=1, shared_prefix=21)
    check_greedy_against_hf(engine, model, batch[:1])
    check_greedy_against_hf(engine, model, batch)
    assert engine.stats().prefix_cache_hits > 0
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_matches_under_preemption(hf_models, draft_of, method):
    folder, model = hf_models("llama-mqa-tied-headdim")
    cfg = model.config
    bytes_per_block = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 4
    # With a draft model both caches share the blocks: twice the bytes per block.
    per_block = bytes_per_block * (2 if method == "draft" else 1)
    engine = speculative_engine(
        folder,
        method,
        draft_of("llama-mqa-tied-headdim"),
        kv_cache_memory=16 * per_block,
        enable_prefix_caching=False,
    )
    assert engine.runner.num_blocks == 16
    check_greedy_against_hf(engine, model, prompts(seed=3))
    assert engine.stats().num_preemptions > 0
    assert engine.stats().spec_decode.num_drafts > 0
    assert_no_blocks_held(engine)


def test_aborting_a_speculating_request_frees_everything(hf_models, draft_of):
    folder, _model = hf_models("llama-gqa")
    engine = speculative_engine(folder, "draft", draft_of("llama-gqa"))
    requests = [engine.add_request(p, greedy(30)) for p in prompts(seed=4)]
    while not any(r.spec_token_ids for r in requests):
        engine.step()
    victim = next(r for r in requests if r.spec_token_ids)
    assert engine.abort(victim.request_id)
    assert victim.request_id not in engine.kv_manager.owned_blocks()
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_blocks_held(engine)
    assert engine.runner.drafter is not None and engine.runner.drafter._probs == {}


def test_stop_strings_end_the_text_where_they_would_without_speculation(hf_models):
    folder, _model = hf_models("llama-gqa")
    batch = prompts(seed=6)
    plain = make_engine(folder).generate(batch, greedy(24), use_tqdm=False)
    # A stop string from the middle of each output; the draft is the model itself, so that the stop falls
    # inside a step's accepted drafts.
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[out.text[8:10]])
        for out in plain
        if out.text and len(out.text) > 12
    ]
    kept = [p for p, out in zip(batch, plain, strict=True) if out.text and len(out.text) > 12]
    assert kept
    expected = make_engine(folder).generate(kept, params, use_tqdm=False)
    engine = speculative_engine(folder, "draft", folder)
    got = engine.generate(kept, params, use_tqdm=False)
    for want, have in zip(expected, got, strict=True):
        assert (have.text, have.token_ids, have.finish_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
        )
    assert engine.stats().spec_decode.num_accepted_tokens > 0
    assert_no_blocks_held(engine)


def test_requests_with_logprobs_or_penalties_decode_without_speculation(hf_models, draft_of):
    folder, _model = hf_models("mistral")
    batch = prompts(seed=7)[:3]
    opted_out = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, presence_penalty=0.5),
    ]
    expected = make_engine(folder).generate(batch, opted_out, use_tqdm=False)
    engine = speculative_engine(folder, "draft", draft_of("mistral"))
    got = engine.generate(batch, opted_out, use_tqdm=False)
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert got[0].all_logprobs is not None and len(got[0].all_logprobs) == 12
    assert engine.stats().spec_decode.num_drafts == 0


# -- sampled output follows the target's distribution ---------------------------------------------------------
def two_sample_chi_square_p_value(a: Counter, b: Counter) -> float:
    """Whether two samples come from one distribution; outcomes seen fewer than 10 times in both samples
    together are pooled into one bin."""
    na, nb = sum(a.values()), sum(b.values())
    keys = set(a) | set(b)
    bins = [(a[k], b[k]) for k in keys if a[k] + b[k] >= 10]
    rest = (sum(a[k] for k in keys if a[k] + b[k] < 10), sum(b[k] for k in keys if a[k] + b[k] < 10))
    if sum(rest) > 0:
        bins.append(rest)
    statistic = 0.0
    for ca, cb in bins:
        total = ca + cb
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        statistic += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    dof = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


def test_two_sample_test_detects_a_different_distribution():
    rng = random.Random(0)
    same_a = Counter(rng.choices(range(8), weights=range(1, 9), k=3000))
    same_b = Counter(rng.choices(range(8), weights=range(1, 9), k=3000))
    other = Counter(rng.choices(range(8), weights=[1, 2, 3, 4, 5, 6, 7, 14], k=3000))
    assert two_sample_chi_square_p_value(same_a, same_b) > 1e-3
    assert two_sample_chi_square_p_value(same_a, other) < 1e-4


SAMPLES = 1500


def sampled_continuations(engine: LLMEngine, prompt: list[int]) -> list[tuple[int, ...]]:
    params = [
        SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True, seed=seed)
        for seed in range(SAMPLES)
    ]
    return [tuple(out.token_ids or ()) for out in engine.generate([prompt] * SAMPLES, params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_output_follows_the_target_distribution(hf_models, draft_of, method):
    """Many seeds with and without speculation: the tokens drafted and verified (the second to the fourth:
    drafts start after the first token) have the same distribution, position by position and as pairs.
    Seeded, so each run draws the same samples: the test cannot flicker."""
    folder, _model = hf_models("llama-gqa")
    prompt = prompts(seed=8)[1]
    plain = sampled_continuations(make_engine(folder, max_num_seqs=64), prompt)
    engine = speculative_engine(
        folder, method, draft_of("llama-gqa"), max_num_seqs=64, speculative_max_batch_size=64
    )
    spec = sampled_continuations(engine, prompt)
    stats = engine.stats().spec_decode
    assert stats.num_draft_tokens > 300
    if method == "draft":
        # Both the accepted drafts and the residual draws after a rejection are in the samples. (A random
        # model's n-gram drafts are almost never likely: that run checks the residual draws.)
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for position in (1, 2, 3):
        p_value = two_sample_chi_square_p_value(
            Counter(s[position] for s in plain), Counter(s[position] for s in spec)
        )
        assert p_value > 1e-3, f"token {position + 1}: p = {p_value}"
    pairs = two_sample_chi_square_p_value(Counter(s[1:3] for s in plain), Counter(s[1:3] for s in spec))
    assert pairs > 1e-3, f"tokens 2 and 3 together: p = {pairs}"
    assert_no_blocks_held(engine)


# -- a draft that cannot draft is refused at start-up ---------------------------------------------------------
def test_a_draft_with_another_vocabulary_is_refused(hf_models, tiny_preset):
    from flotilla.engine.model.config import ModelLoadError

    folder, _model = hf_models("llama-gqa")
    with pytest.raises(ModelLoadError) as caught:
        speculative_engine(folder, "draft", tiny_preset)
    message = str(caught.value)
    assert f"--speculative-model {tiny_preset}: its vocabulary has" in message
    assert "the model's 258" in message and "must share the model's tokenizer and vocabulary" in message


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused(hf_models, draft_of, tmp_path, capsys):
    import json

    from flotilla.cli import main

    folder, _model = hf_models("llama-gqa")
    draft = tmp_path / "swapped"
    shutil.copytree(draft_of("llama-gqa"), draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two tokens mean other things
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    args = ["engine", "serve", "--model", str(folder), "--port", "1", "--speculative-method", "draft",
            "--speculative-model", str(draft)]  # fmt: skip
    assert main(args) == 2  # refused before loading or listening
    err = capsys.readouterr().err
    assert (
        f"--speculative-model {draft}: its tokenizer differs from the model's (4 token entries differ)" in err
    )


def test_a_draft_shorter_than_the_context_is_refused(hf_models, draft_of, tmp_path):
    import json

    from flotilla.engine.model.config import ModelLoadError

    folder, _model = hf_models("llama-gqa")  # 256 positions
    draft = tmp_path / "short"
    shutil.copytree(draft_of("llama-gqa"), draft)
    config = json.loads((draft / "config.json").read_text())
    config["max_position_embeddings"] = 128
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match="it handles 128 positions, fewer than the context of 256 tokens"
    ):
        speculative_engine(folder, "draft", draft)
    speculative_engine(folder, "draft", draft, max_model_len=128)  # a shorter context is fine
