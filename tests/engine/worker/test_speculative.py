"""Speculative decoding's parts, alone: n-gram lookup, the scheduler's draft slots and rollback, the
rejection sampler's output distribution, and the settings refused at start-up."""

from __future__ import annotations

import random

import pytest
import torch

from flotilla.engine.config import EngineConfig
from flotilla.engine.core.kv_cache_manager import KVCacheManager
from flotilla.engine.core.ngram_proposer import NgramProposer
from flotilla.engine.core.outputs import SpecDecodeStats
from flotilla.engine.core.request import FinishReason, Request
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.core.scheduler import Scheduler, SchedulerConfig
from flotilla.engine.worker.rejection_sampler import RejectionSampler
from flotilla.engine.worker.sampler import Sampler


def chi_square_p_value(observed: list[int], expected_probs: list[float]) -> float:
    """Pearson's goodness of fit; bins expected to hold fewer than 5 samples are pooled into one."""
    total = sum(observed)
    pairs = sorted(zip(expected_probs, observed, strict=True), reverse=True)
    bins: list[list[float]] = []
    pooled = [0.0, 0.0]
    for prob, count in pairs:
        if prob * total >= 5:
            bins.append([prob * total, count])
        else:
            pooled[0] += prob * total
            pooled[1] += count
    if pooled[0] > 0:
        bins.append(pooled)
    statistic = sum((obs - exp) ** 2 / exp for exp, obs in bins if exp > 0)
    dof = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


# -- n-gram lookup ------------------------------------------------------------------------------------
def brute_force_ngram(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_proposes_what_followed_the_latest_earlier_match():
    proposer = NgramProposer(max_n=3, min_n=1)
    request = Request("r", [5, 6, 7, 8, 9, 5, 6], SamplingParams())
    assert proposer.propose_one(request, 3) == [7, 8, 9]
    request.append_output_token(7)
    assert proposer.propose_one(request, 3) == [8, 9, 5]
    request.append_output_token(1)  # 1 never appeared before
    assert proposer.propose_one(request, 3) == []


def test_ngram_prefers_the_longest_match():
    proposer = NgramProposer(max_n=2, min_n=1)
    # The 1-gram [3] last occurred before 9; the 2-gram [2, 3] before 4.
    request = Request("r", [2, 3, 4, 0, 3, 9, 2, 3], SamplingParams())
    assert proposer.propose_one(request, 1) == [4]


def test_ngram_index_matches_a_brute_force_search_as_tokens_arrive():
    rng = random.Random(0)
    for trial in range(30):
        proposer = NgramProposer(max_n=3, min_n=1)
        request = Request(f"r{trial}", [rng.randrange(4) for _ in range(rng.randint(1, 6))], SamplingParams())
        for _ in range(40):
            k = rng.randint(1, 5)
            expected = brute_force_ngram(request.all_token_ids, k, 3, 1)
            assert proposer.propose_one(request, k) == expected
            for _ in range(rng.randint(1, 3)):
                request.append_output_token(rng.randrange(4))


def test_ngram_refuses_bad_sizes():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(max_n=1, min_n=2)


# -- the scheduler's side -------------------------------------------------------------------------------
def make_scheduler(num_blocks=64, block_size=4, max_len=64, budget=64) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_len), kv
    )


def decoding_request(sched: Scheduler, rid: str = "r", prompt_len: int = 6, max_tokens: int = 50) -> Request:
    request = Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens))
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, {item.request.request_id: [99] for item in out.scheduled if item.samples})
    assert request.is_decoding
    return request


def test_drafts_are_verified_in_one_chunk_and_rejected_ones_release_their_blocks():
    sched = make_scheduler()
    request = decoding_request(sched)  # 7 tokens, 6 with KV: 2 blocks of 4
    assert sched.reserve_draft_slots(request, 5) == 5  # slots for positions 6..11: 3 blocks
    assert len(request.block_ids) == 3
    request.spec_token_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.spec_token_ids) == (6, 6, [1, 2, 3, 4, 5])
    assert item.samples and request.spec_token_ids == []
    # Two drafts accepted, then the target's own token.
    sched.update_from_output(out, {"r": [1, 2, 77]})
    assert request.output_token_ids == [99, 1, 2, 77]
    assert request.num_computed_tokens == 9  # up to and including draft 2
    assert len(request.block_ids) == 3  # positions 0..8 need 3 blocks; nothing to release
    # Only verified tokens' blocks enter the prefix cache: the drafts' block 2 held 11, 2, 3, 4, 5 in the
    # step, and is registered once full of verified tokens, at the next allocation.
    assert sched.reserve_draft_slots(request, 4) == 4  # positions 9..13: 4 blocks
    cached_keys = [block.hash_key for block in sched.kv.pool.cached.values()]
    assert [list(key[1]) for key in cached_keys if key] == [[10, 11, 12, 13], [14, 15, 99, 1]]
    assert len(request.block_ids) == 4
    request.spec_token_ids = [6, 7, 8, 9]
    out = sched.schedule()
    sched.update_from_output(out, {"r": [55]})  # the first draft rejected
    assert request.num_computed_tokens == 10
    assert len(request.block_ids) == 3  # the fourth block held only rejected drafts
    assert sched.kv.pool.num_free_blocks == 64 - 3
    sched.finish_request("r", FinishReason.STOP)
    assert sched.kv.pool.num_free_blocks == 64


def test_a_stop_inside_the_accepted_drafts_drops_the_tokens_after_it():
    sched = make_scheduler()
    request = decoding_request(sched, max_tokens=3)
    sched.reserve_draft_slots(request, 4)
    request.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()
    results = sched.update_from_output(out, {"r": [1, 2, 3, 4, 5]})
    assert results == [(request, [1, 2])]  # max_tokens=3: 99, 1, 2
    assert request.finish_reason == FinishReason.LENGTH
    assert sched.kv.pool.num_free_blocks == 64


def test_draft_slots_never_preempt_and_stop_at_the_context():
    sched = make_scheduler(num_blocks=3, block_size=4, max_len=12)
    request = decoding_request(sched)  # 7 tokens: 2 blocks
    other = decoding_request(sched, "o", prompt_len=2)  # 3 tokens: the last block; r decoded to 8 tokens
    assert sched.kv.pool.num_free_blocks == 0
    assert sched.reserve_draft_slots(request, 4) == 0  # would need a fourth block: no drafts
    assert other.status.value == "running" and sched.num_preemptions == 0
    sched.finish_request("o", FinishReason.STOP)
    # Positions up to 11 exist: 8 tokens known, so at most 12 - 8 = 4 drafts of the 9 asked for.
    assert sched.reserve_draft_slots(request, 9) == 4


def test_reserving_draft_slots_registers_no_block_whose_kv_is_not_written():
    """A block that the next step fills (its last token has no KV yet) stays out of the prefix cache until
    that step: were the request preempted first, a later hit would read KV that was never written."""
    sched = make_scheduler()
    request = decoding_request(sched, prompt_len=7)  # 8 tokens, 7 with KV: block 1 ends with the new token
    assert sched.reserve_draft_slots(request, 3) == 3
    cached = [list(key[1]) for key in (b.hash_key for b in sched.kv.pool.cached.values()) if key]
    assert cached == [[10, 11, 12, 13]]
    request.spec_token_ids = [1, 2, 3]
    sched.schedule()  # the step that writes position 7 registers block 1
    cached = [list(key[1]) for key in (b.hash_key for b in sched.kv.pool.cached.values()) if key]
    assert cached == [[10, 11, 12, 13], [14, 15, 16, 99]]


def test_preemption_drops_drafts_and_the_draft_models_kv():
    sched = make_scheduler(num_blocks=4, block_size=4)
    request = decoding_request(sched, prompt_len=7)  # 8 tokens, 7 with KV: 2 blocks
    request.spec_token_ids = [1, 2]
    request.num_draft_computed_tokens = 7
    other = Request("o", list(range(30, 45)), SamplingParams(max_tokens=4), priority=-1)
    sched.add_request(other)
    sched._preempt(request)
    assert request.spec_token_ids == [] and request.num_draft_computed_tokens == 0
    assert request.num_computed_tokens == 0


def test_the_draft_models_kv_is_cut_back_to_the_verified_tokens():
    sched = make_scheduler()
    request = decoding_request(sched)  # 7 tokens, 6 with KV
    sched.reserve_draft_slots(request, 3)
    request.spec_token_ids = [1, 2, 3]
    # The draft model was fed the last token (position 6), draft 1 (7) and draft 2 (8).
    request.num_draft_computed_tokens = 9
    out = sched.schedule()
    sched.update_from_output(out, {"r": [1, 50]})  # draft 1 accepted; position 8 holds 50, not draft 2
    assert request.num_computed_tokens == 8
    assert request.num_draft_computed_tokens == 8
    sched.reserve_draft_slots(request, 3)
    request.spec_token_ids = [4, 5, 6]
    request.num_draft_computed_tokens = 11  # fed 50 (8), draft 4 (9) and draft 5 (10)
    out = sched.schedule()
    sched.update_from_output(out, {"r": [7]})  # draft 4 rejected
    assert request.num_draft_computed_tokens == 9  # positions 0..8 hold verified tokens


def test_drafts_are_cut_to_the_step_budget():
    sched = make_scheduler(budget=3)
    request = decoding_request(sched, prompt_len=3)
    sched.reserve_draft_slots(request, 5)
    request.spec_token_ids = [1, 2, 3, 4, 5]
    (item,) = sched.schedule().scheduled
    assert item.num_new_tokens == 3 and item.spec_token_ids == [1, 2]


def test_spec_stats_count_acceptance_per_position():
    stats = SpecDecodeStats(accepted_per_position=[0, 0, 0])
    stats.observe(3, 2)
    stats.observe(3, 0)
    stats.observe(2, 2)
    assert stats.num_drafts == 3 and stats.num_draft_tokens == 8 and stats.num_accepted_tokens == 4
    assert stats.accepted_per_position == [2, 2, 0]
    assert stats.acceptance_rate == 0.5
    assert stats.mean_accepted_length == pytest.approx(1 + 4 / 3)


def test_requests_that_speculation_cannot_serve_say_why():
    assert SamplingParams(logprobs=0).speculation_opt_out == "logprobs"
    assert SamplingParams(repetition_penalty=1.2).speculation_opt_out == "penalties"
    assert SamplingParams(temperature=0.7, top_p=0.9).speculation_opt_out is None


# -- the rejection sampler --------------------------------------------------------------------------------
VOCAB = 6
TRIALS = 6000


def distributions(seed: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, VOCAB, generator=gen) * 1.5, dim=-1)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_rejection_sampling_keeps_the_target_distribution(method):
    """The first token follows p_1 whatever was drafted, and, when the first draft is accepted, the
    second follows p_2: what plain sampling from the target would give."""
    k = 2
    target = distributions(1, k + 1)
    draft = distributions(2, k)
    sampler = RejectionSampler(Sampler(torch.device("cpu")))
    logits = target.log()
    firsts, seconds = [0] * VOCAB, [0] * VOCAB
    draw = torch.Generator().manual_seed(3)
    for trial in range(TRIALS):
        request = Request(f"t{trial}", [1], SamplingParams(temperature=1.0, seed=trial))
        if method == "draft":
            drafts = [int(torch.multinomial(draft[i], 1, generator=draw)) for i in range(k)]
            tokens = sampler(logits, request, drafts, draft)
        else:  # a fixed guess, certain to the proposer: q is one-hot
            drafts = [2, 4]
            tokens = sampler(logits, request, drafts, None)
        assert 1 <= len(tokens) <= k + 1 and tokens[:-1] == drafts[: len(tokens) - 1]
        firsts[tokens[0]] += 1
        if len(tokens) >= 2 and tokens[0] == drafts[0]:
            seconds[tokens[1]] += 1
        sampler.sampler.forget(request.request_id)
    assert chi_square_p_value(firsts, target[0].tolist()) > 1e-3
    assert sum(seconds) > 500
    assert chi_square_p_value(seconds, target[1].tolist()) > 1e-3


def test_chi_square_helper_rejects_a_wrong_distribution():
    """The test above could fail: the same counts against another distribution are refused."""
    target = distributions(1, 1)[0]
    counts = torch.bincount(torch.multinomial(target, TRIALS, replacement=True), minlength=VOCAB).tolist()
    assert chi_square_p_value(counts, target.tolist()) > 1e-3
    assert chi_square_p_value(counts, distributions(2, 1)[0].tolist()) < 1e-6


def test_greedy_verification_accepts_exactly_the_argmax_prefix():
    sampler = RejectionSampler(Sampler(torch.device("cpu")))
    logits = torch.full((4, VOCAB), -5.0)
    for row, best in enumerate([3, 1, 4, 0]):
        logits[row, best] = 5.0
    request = Request("g", [1], SamplingParams(temperature=0.0))
    assert sampler(logits, request, [3, 1, 4], None) == [3, 1, 4, 0]  # all accepted, then the bonus
    assert sampler(logits, request, [3, 2, 4], None) == [3, 1]  # the second rejected: the argmax instead
    assert sampler(logits, request, [0, 1, 4], None) == [3]


# -- settings refused at start-up -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"speculative_method": "medusa"}, "--speculative-method medusa: must be one of none, ngram, draft"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "--num-speculative-tokens 0: must be between 1 and 16"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 17}, "--num-speculative-tokens 17: must be between 1 and 16"),
        ({"speculative_method": "draft"}, "--speculative-method draft: needs --speculative-model"),
        ({"speculative_method": "ngram", "speculative_model": "/m"}, "--speculative-model /m: only used with --speculative-method draft, not ngram"),
        ({"speculative_max_batch_size": 0}, "--speculative-max-batch-size 0: must be 1 or more"),
    ],
)  # fmt: skip
def test_bad_speculative_settings_are_refused_with_the_rule(options, message):
    with pytest.raises(ValueError) as caught:
        EngineConfig(model="/m", **options)
    assert message in str(caught.value)
