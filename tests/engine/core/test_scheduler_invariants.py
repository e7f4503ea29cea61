"""Hypothesis: over any sequence of add, step, abort and finish, no KV block leaks or has two owners
(shared prefix blocks aside, which are reference counted), and reference counts match block tables."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flotilla.contract import SCHEDULING_POLICIES
from flotilla.engine.core.kv_cache_manager import KVCacheManager
from flotilla.engine.core.request import FinishReason, Request, RequestStatus
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.core.scheduler import Scheduler, SchedulerConfig

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 40),  # prompt length
            st.integers(1, 12),  # max tokens
            st.integers(0, 2),  # priority
            st.integers(0, 3),  # which shared prefix
        ),
        st.tuples(st.just("step"), st.integers(0, 5)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
    ),
    max_size=60,
)


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    pool = kv.pool
    owned = kv.owned_blocks()
    live = {r.request_id for r in sched.running}
    # Only running requests hold blocks; waiting (and preempted) ones hold none.
    assert set(owned) <= live, (set(owned), live)
    for r in sched.waiting:
        assert r.block_ids == [] and r.num_computed_tokens == 0
    refs = Counter()
    for rid, blocks in owned.items():
        assert len(blocks) == len(set(blocks)), f"{rid} holds a block twice"
        assert sched.requests[rid].block_ids == blocks
        refs.update(blocks)
    for block in pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0), block
        # A block with two owners must be a shared, cached prefix block.
        if block.ref_cnt > 1:
            assert block.block_hash is not None
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}  # nothing leaked
    for h, block in pool.cached.items():
        assert block.block_hash == h
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        assert len(r.block_ids) * kv.block_size >= r.num_computed_tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(3, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 48),
    policy=st.sampled_from(SCHEDULING_POLICIES),
)
def test_block_accounting_holds_under_any_sequence(ops, num_blocks, block_size, budget, policy):
    max_len = min(num_blocks * block_size, 64)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=max_len, policy=policy),
        KVCacheManager(num_blocks, block_size),
    )
    ids = []
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, prio, prefix = op
            n = min(n, max_len - 1)
            prompt = [prefix * 1000 + i for i in range(n)]
            rid = f"r{len(ids)}"
            ids.append(rid)
            tenant = "ab"[prefix % 2]
            params = SamplingParams(max_tokens=max_tokens)
            sched.add_request(Request(rid, prompt, params, priority=prio, tenant=tenant))
        elif op[0] == "step":
            out = sched.schedule()
            assert out.num_batched_tokens <= budget
            assert len(sched.running) <= 6
            check_invariants(sched)
            sampled = {s.request.request_id: [op[1]] for s in out.scheduled if s.samples}
            sched.update_from_output(out, sampled)
        elif ids:
            rid = ids[op[1] % len(ids)]
            reason = FinishReason.ABORT if op[0] == "abort" else FinishReason.STOP
            sched.finish_request(rid, reason)
        check_invariants(sched)
    # Everything can always drain, and then every block is free again.
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: [0] for s in out.scheduled if s.samples})
        check_invariants(sched)
    assert not sched.has_unfinished()
    assert sched.kv.pool.num_free_blocks == num_blocks


spec_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 2), st.integers(0, 3)
        ),
        st.tuples(st.just("step"), st.integers(0, 1000)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    max_size=60,
)


def step_with_drafts(sched: Scheduler, written: dict, accept: int, num_drafts: int, token: int) -> None:
    """One engine step as LLMEngine runs it with speculation, the model simulated: writes each scheduled
    token's KV slot (recording which token it holds), accepts a varying number of each request's drafts,
    then reserves slots and proposes new drafts for every decoding request."""
    bs = sched.kv.block_size
    out = sched.schedule()
    sampled = {}
    for i, item in enumerate(out.scheduled):
        request, start, n, spec = (
            item.request,
            item.num_computed_tokens,
            item.num_new_tokens,
            item.spec_token_ids,
        )
        tokens = request.all_token_ids[start : start + n - len(spec)] + spec
        for position, tok in zip(range(start, start + n), tokens, strict=True):
            written[(request.block_ids[position // bs], position % bs)] = tok
        if item.samples:
            accepted = (accept + i) % (len(spec) + 1)
            sampled[request.request_id] = spec[:accepted] + [token]
    sched.update_from_output(out, sampled)
    for request in list(sched.running):
        k = sched.reserve_draft_slots(request, num_drafts)
        request.spec_token_ids = [token + 1 + j for j in range(k)]


def check_cache_holds_written_tokens(sched: Scheduler, written: dict) -> None:
    """Every block in the prefix cache holds, slot by slot, KV written for exactly the tokens its hash
    names: no draft that was rejected and no slot that was never written."""
    for block in sched.kv.pool.cached.values():
        assert block.hash_key is not None
        slots = [written.get((block.block_id, i)) for i in range(sched.kv.block_size)]
        assert slots == list(block.hash_key[1]), (block, slots)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=spec_ops,
    num_blocks=st.integers(3, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 48),
    num_drafts=st.integers(1, 5),
)
def test_speculation_keeps_blocks_and_the_prefix_cache_sound(ops, num_blocks, block_size, budget, num_drafts):
    max_len = min(num_blocks * block_size, 64)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=max_len),
        KVCacheManager(num_blocks, block_size),
    )
    written: dict = {}
    ids: list[str] = []
    token = 10_000
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, prio, prefix = op
            prompt = [prefix * 1000 + i for i in range(min(n, max_len - 1))]
            rid = f"r{len(ids)}"
            ids.append(rid)
            sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=prio))
        elif op[0] == "step":
            token += 100
            step_with_drafts(sched, written, op[1], num_drafts, token)
        elif ids:
            sched.finish_request(ids[op[1] % len(ids)], FinishReason.ABORT)
        check_invariants(sched)
        check_cache_holds_written_tokens(sched, written)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        token += 100
        step_with_drafts(sched, written, token, num_drafts, token)
        check_invariants(sched)
        check_cache_holds_written_tokens(sched, written)
    assert not sched.has_unfinished()
    assert sched.kv.pool.num_free_blocks == num_blocks
