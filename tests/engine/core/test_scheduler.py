"""Scheduler: continuous batching, chunked prefill, preemption, priorities, aborts. No torch."""

from __future__ import annotations

from flotilla.engine.core.kv_cache_manager import KVCacheManager
from flotilla.engine.core.request import FinishReason, Request, RequestStatus
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.core.scheduler import Scheduler, SchedulerConfig


def make_scheduler(
    num_blocks=64, block_size=4, budget=32, max_seqs=8, max_len=256, caching=True, policy="priority"
):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, max_len, policy=policy), kv)


def req(rid, n_prompt, max_tokens=4, priority=0, base=0):
    return Request(
        rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens), priority=priority
    )


def run_step(sched: Scheduler, token: int = 1):
    out = sched.schedule()
    sampled = {s.request.request_id: [token] for s in out.scheduled if s.samples}
    sched.update_from_output(out, sampled)
    return out


def test_chunked_prefill_mixes_with_decodes():
    sched = make_scheduler(budget=8)
    sched.add_request(req("short", 3))
    run_step(sched)  # prefill of "short" (3 tokens), samples one token
    sched.add_request(req("long", 20, base=100))
    out = run_step(sched)
    plan = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert plan == {"short": 1, "long": 7}  # the decode first, the rest of the budget to a chunk
    out = run_step(sched)
    plan = {s.request.request_id: (s.num_new_tokens, s.samples) for s in out.scheduled}
    assert plan == {"short": (1, True), "long": (7, False)}
    out = run_step(sched)
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled}["long"] == 6
    assert sched.requests["long"].num_output_tokens == 1


def test_max_num_seqs_limits_the_running_batch():
    sched = make_scheduler(max_seqs=2, budget=100)
    for i in range(4):
        sched.add_request(req(f"r{i}", 2, base=10 * i))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_priority_then_fcfs():
    sched = make_scheduler(max_seqs=1)
    sched.add_request(req("late-low", 2, priority=5))
    sched.add_request(req("a", 2, priority=0, base=10))
    sched.add_request(req("b", 2, priority=0, base=20))
    assert [r.request_id for r in sched.waiting] == ["a", "b", "late-low"]


def test_preemption_takes_the_newest_lowest_priority_and_requeues_it_first():
    # 4 blocks of 4 tokens. Two requests of 7 tokens take 2 blocks each; decoding needs a third.
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64, caching=False)
    sched.add_request(req("old", 7, max_tokens=10))
    sched.add_request(req("new", 7, max_tokens=10, base=50))
    sched.add_request(req("later", 3, max_tokens=10, base=90))
    run_step(sched)  # both prefill; "later" does not fit
    out = run_step(sched)  # each now has 8 tokens: fine, blocks full
    assert not out.preempted
    out = run_step(sched)  # 9th token needs a new block for "old": "new" is preempted
    assert out.preempted == ["new"]
    assert [s.request.request_id for s in out.scheduled] == ["old"]
    new = sched.requests["new"]
    assert new.status == RequestStatus.WAITING and new.num_computed_tokens == 0 and new.block_ids == []
    assert [r.request_id for r in sched.waiting] == ["new", "later"]  # back at the head, before "later"
    assert sched.num_preemptions == 1


def test_a_preempted_request_recomputes_its_outputs_then_continues():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64, caching=False)
    sched.add_request(req("a", 7, max_tokens=3))
    sched.add_request(req("b", 7, max_tokens=3, base=50))
    for _ in range(3):
        run_step(sched)
    b = sched.requests.get("b")
    for _ in range(20):
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert not sched.has_unfinished()
    assert b is not None and b.num_output_tokens == 3 and b.finish_reason == FinishReason.LENGTH


def test_abort_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(req("a", 10))
    run_step(sched)
    assert sched.kv.pool.num_free_blocks < 8
    sched.finish_request("a", FinishReason.ABORT)
    assert sched.kv.pool.num_free_blocks == 8 and not sched.has_unfinished()
    assert sched.finish_request("a", FinishReason.ABORT) is None


def test_eos_stop_ids_and_min_tokens():
    sched = make_scheduler()
    r = Request(
        "a",
        [1, 2],
        SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[7]),
        eos_token_ids=frozenset({9}),
    )
    sched.add_request(r)
    run_step(sched, token=9)  # eos before min_tokens: ignored
    assert not r.is_finished
    run_step(sched, token=9)
    assert r.is_finished and r.finish_reason == FinishReason.STOP
    r2 = Request(
        "b",
        [1, 2],
        SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[7]),
        eos_token_ids=frozenset({9}),
    )
    sched.add_request(r2)
    run_step(sched, token=9)
    assert not r2.is_finished
    run_step(sched, token=7)
    assert r2.finish_reason == FinishReason.STOP


def test_context_length_finishes_with_length():
    sched = make_scheduler(max_len=6)
    r = req("a", 4, max_tokens=100)
    sched.add_request(r)
    run_step(sched)
    run_step(sched)
    assert r.finish_reason == FinishReason.LENGTH and r.num_tokens == 6


def test_prompt_too_long_is_rejected():
    sched = make_scheduler(max_len=6)
    try:
        sched.add_request(req("a", 6))
    except ValueError as exc:
        assert "context" in str(exc)
    else:
        raise AssertionError("expected a ValueError")


def test_identical_prompts_admitted_in_one_step_share_blocks():
    sched = make_scheduler(budget=100)
    sched.add_request(req("a", 9))
    sched.add_request(req("b", 9))
    out = sched.schedule()
    plan = {s.request.request_id: (s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled}
    assert plan == {"a": (0, 9), "b": (8, 1)}
    assert sched.kv.prefix_cache_queries == 18 and sched.kv.prefix_cache_hits == 8
