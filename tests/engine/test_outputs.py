"""Detokenization, stop strings, stop tokens, streaming deltas and the async wrapper."""

from __future__ import annotations

import asyncio

import pytest

from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.text.detokenizer import IncrementalDetokenizer
from flotilla.engine.text.tokenizer import load_tokenizer

TEXT = "naïve café — 日本語 😀 ok"


def test_incremental_detokenizer_never_splits_a_character(hf_models, tiny_preset):
    folder, _ = hf_models("qwen2-bias-tied")  # one token per byte: the hardest case
    for path in (folder, tiny_preset):
        tok = load_tokenizer(path)
        ids = tok.encode(TEXT, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, tok.encode("hello", add_special_tokens=False))
        deltas = [detok.add(t) for t in ids]
        assert "".join(deltas) + detok.flush() == TEXT
        assert not any("\ufffd" in d for d in deltas)
    assert len(ids) < len(TEXT.encode())  # the preset's BPE merges bytes


def test_unfinished_character_at_the_end_becomes_a_replacement(hf_models):
    folder, _ = hf_models("qwen2-bias-tied")
    tok = load_tokenizer(folder)
    ids = tok.encode("日", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [0])
    assert [detok.add(t) for t in ids[:2]] == ["", ""]
    assert detok.flush() == "\ufffd"


def greedy(engine, prompt, **params):
    base = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    return engine.generate([prompt], SamplingParams(**{**base, **params}), use_tqdm=False)[0]


def test_stop_string_truncates_and_streaming_deltas_add_up(tiny_engine):
    prompt = [0, 11, 12, 13]
    full = greedy(tiny_engine, prompt)
    text = full.text
    assert len(text) >= 6
    stop = text[3:5]
    first = text.find(stop)
    tiny_engine.add_request(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop, "never"]),
        request_id="s",
    )
    deltas, final = [], None
    while tiny_engine.has_unfinished_requests():
        for out in tiny_engine.step():
            deltas.append(out.new_text)
            final = out
    assert final is not None and final.finished and final.finish_reason == "stop"
    assert final.text == text[:first] == "".join(deltas)


def test_stop_token_ids_and_max_tokens(tiny_engine):
    prompt = [0, 50, 60]
    full = greedy(tiny_engine, prompt, max_tokens=8)
    assert full.finish_reason == "length" and len(full.token_ids) == 8
    stop_at = full.token_ids[4]
    cut = greedy(tiny_engine, prompt, max_tokens=8, stop_token_ids=[stop_at])
    assert cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[: full.token_ids.index(stop_at) + 1]


def test_seeded_sampling_is_reproducible_through_the_engine(tiny_engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=12, ignore_eos=True)
    a = tiny_engine.generate([[0, 1, 2]], params, use_tqdm=False)[0]
    b = tiny_engine.generate([[0, 1, 2], [0, 7, 7, 7]], params, use_tqdm=False)[0]
    assert a.token_ids == b.token_ids


def test_bad_requests_get_clear_errors(tiny_engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_engine.add_request([0, 10_000])
    with pytest.raises(ValueError, match="context"):
        tiny_engine.add_request([1] * tiny_engine.max_model_len)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_abort_frees_blocks_and_is_counted(tiny_engine):
    before = tiny_engine.stats()
    tiny_engine.add_request([0, 1, 2, 3, 4, 5], SamplingParams(max_tokens=50), request_id="gone")
    tiny_engine.step()
    assert tiny_engine.kv_manager.usage() > 0
    assert tiny_engine.abort("gone")
    assert tiny_engine.kv_manager.usage() == 0
    after = tiny_engine.stats()
    assert after.finished_by_reason.get("abort", 0) == before.finished_by_reason.get("abort", 0) + 1
    assert not tiny_engine.abort("gone")


def test_async_engine_streams_concurrently_and_aborts_on_exit(tiny_engine):
    from flotilla.engine.async_engine import AsyncEngine

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [greedy(tiny_engine, p, max_tokens=10).token_ids for p in ([0, 3, 4], [0, 9])]

    async def collect(engine, prompt, rid):
        tokens, text, last = [], "", None
        async for out in engine.generate(prompt, params, request_id=rid):
            tokens += out.new_token_ids
            text += out.new_text
            last = out
        return tokens, text, last

    async def leave_early(engine):
        async for out in engine.generate(
            [0, 5, 5], SamplingParams(max_tokens=200, ignore_eos=True), request_id="early"
        ):
            if out.num_output_tokens >= 2:
                break

    def aborts() -> int:
        return tiny_engine.stats().finished_by_reason.get("abort", 0)

    async def main():
        engine = AsyncEngine(tiny_engine)
        results = await asyncio.gather(
            collect(engine, [0, 3, 4], "a"), collect(engine, [0, 9], "b"), leave_early(engine)
        )
        # The worker applies the abort between steps: wait for it, not for a fixed time (a busy machine
        # may take longer); the deadline only keeps a broken engine from hanging the test.
        deadline = asyncio.get_running_loop().time() + 60
        while tiny_engine.has_unfinished_requests() or aborts() == before:
            assert asyncio.get_running_loop().time() < deadline, "the worker never applied the abort"
            await asyncio.sleep(0.01)
        await engine.shutdown()
        return results

    before = aborts()
    (a, b, _) = asyncio.run(main())
    assert [a[0], b[0]] == expected
    assert a[2].finished and a[2].finish_reason == "length" and a[1] == a[2].text
    assert (
        a[2].first_token_time is not None
        and a[2].last_token_time >= a[2].first_token_time >= a[2].arrival_time
    )
    assert aborts() == before + 1
    assert not tiny_engine.has_unfinished_requests() and tiny_engine.kv_manager.usage() == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(hf_models, dtype):
    import torch

    from flotilla.engine.config import EngineConfig
    from flotilla.engine.llm_engine import LLMEngine

    folder, _ = hf_models("llama-gqa")
    engine = LLMEngine(
        EngineConfig(
            model=str(folder),
            device="cpu",
            dtype=dtype,
            block_size=4,
            kv_cache_memory=1 << 20,
            show_progress=False,
        )
    )
    assert engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    out = engine.generate(
        [[0, 1, 2, 3]],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )[0]
    assert len(out.token_ids) == 4 and all(lp.logprob <= 0 for lp in out.all_logprobs)


def test_priorities_are_served_first_when_the_batch_is_full(hf_models):
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.llm_engine import LLMEngine

    folder, _ = hf_models("llama-gqa")
    engine = LLMEngine(
        EngineConfig(
            model=str(folder),
            device="cpu",
            dtype="float32",
            block_size=4,
            max_num_seqs=1,
            kv_cache_memory=1 << 20,
            show_progress=False,
            scheduling_policy="priority",
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request([0, 1], params, request_id="low", priority=5)
    engine.add_request([0, 2], params, request_id="high", priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]
