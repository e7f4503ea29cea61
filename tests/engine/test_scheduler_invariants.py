"""Hypothesis: over any sequence of add, step, abort and finish, no KV block leaks or has two owners
(shared prefix blocks aside, which are reference counted), and reference counts match block tables."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flotilla.engine.core.kv_cache_manager import KVCacheManager
from flotilla.engine.core.policy import POLICIES
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
    policy=st.sampled_from(POLICIES),
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
