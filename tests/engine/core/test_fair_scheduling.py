"""Tenant-fair scheduling (the Virtual Token Counter) in the real scheduler and KV-cache manager, driven
step by step with a stand-in for the model. Deterministic and torch-free: it asserts what the policy
guarantees, never a timing."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flotilla.contract import SCHEDULING_POLICIES
from flotilla.engine.core.fair_share import FairShareConfig, FairShareLedger
from flotilla.engine.core.kv_cache_manager import KVCacheManager
from flotilla.engine.core.request import Request
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.core.scheduler import Scheduler, SchedulerConfig

_ids = itertools.count()


def _request(tenant: str, prompt_len: int, output_len: int, priority: int = 0) -> Request:
    rid = f"{tenant}-{next(_ids)}"
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    # Distinct token ids per request: no prefix-cache hits blur the accounting.
    prompt = [hash((rid, i)) % 30_000 for i in range(prompt_len)]
    return Request(rid, prompt, params, priority=priority, tenant=tenant)


def _scheduler(policy: str, num_blocks: int = 32, block_size: int = 4, budget: int = 32, weights=None):
    config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=budget,
        max_model_len=num_blocks * block_size,
        policy=policy,
        fair_share=FairShareConfig(tenant_weights=weights or {}),
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=False))


def _step(sched: Scheduler):
    out = sched.schedule()
    sched.update_from_output(out, {s.request.request_id: [7] for s in out.scheduled if s.samples})
    return out


def _waiting_of(sched: Scheduler, tenant: str) -> int:
    return sum(r.tenant == tenant for r in sched.waiting)


workload = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 24)), min_size=4, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a_jobs=workload, b_jobs=workload, budget=st.integers(4, 64), steps=st.integers(50, 400))
def test_backlogged_tenants_stay_within_the_vtc_bound(a_jobs, b_jobs, budget, steps):
    """While both tenants are continuously backlogged, the difference in weighted service they receive
    over any interval stays within 2 x max(w_in x longest prompt, w_out x KV capacity in tokens)."""
    sched = _scheduler("fair", budget=budget)
    jobs = {"a": itertools.cycle(a_jobs), "b": itertools.cycle(b_jobs)}
    capacity = 32 * 4
    longest_prompt = max(p for p, _ in a_jobs + b_jobs)
    bound = sched.ledger.bound(longest_prompt, capacity)
    gaps = []
    for _ in range(steps):
        for tenant, it in jobs.items():  # keep both tenants backlogged: two waiting requests each
            while _waiting_of(sched, tenant) < 2:
                prompt, output = next(it)
                sched.add_request(_request(tenant, prompt, output))
        _step(sched)
        gaps.append(sched.ledger.counter("a") - sched.ledger.counter("b"))
    assert max(gaps) - min(gaps) <= bound


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(SCHEDULING_POLICIES),
    arrivals=st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 2)),
        min_size=1,
        max_size=40,
    ),
    budget=st.integers(1, 48),
)
def test_no_idle_step_with_work_waiting_and_every_request_finishes(policy, arrivals, budget):
    """Work conservation (every step schedules something while requests are unfinished) and no
    starvation (everything finishes), under every policy."""
    sched = _scheduler(policy, budget=budget)
    requests = [_request(t, p, o, priority=prio) for t, p, o, prio in arrivals]
    pending = list(requests)
    for step in itertools.count():
        if pending and step % 2 == 0:  # arrivals interleave with steps
            sched.add_request(pending.pop(0))
        if not sched.has_unfinished() and not pending:
            break
        if sched.has_unfinished():
            out = _step(sched)
            assert out.scheduled, f"step {step}: nothing scheduled with {len(sched.waiting)} waiting"
        assert step < 20_000, "a request starved"
    assert all(r.is_finished for r in requests)
    assert sched.kv.pool.num_free_blocks == 32  # nothing leaked
    assert all(s.outstanding == 0 for s in sched.ledger.tenants.values())


def _flood(policy: str, weights=None, steps: int = 3000) -> dict[str, int]:
    """Tenant `loud` keeps 20 requests waiting, `quiet` keeps 2; returns output tokens served each."""
    sched = _scheduler(policy, budget=16, weights=weights)
    for _ in range(steps):
        for tenant, depth in (("loud", 20), ("quiet", 2)):
            while _waiting_of(sched, tenant) < depth:
                sched.add_request(_request(tenant, 8, 8))
        _step(sched)
    return {t: s.generation_tokens for t, s in sched.ledger.tenants.items()}


def test_fair_splits_service_evenly_where_fcfs_follows_the_flood():
    fcfs, fair = _flood("fcfs"), _flood("fair")
    assert fcfs["loud"] > 4 * fcfs["quiet"]  # fcfs serves in arrival order: the flood dominates
    assert abs(fair["loud"] - fair["quiet"]) <= 0.05 * (fair["loud"] + fair["quiet"])
    # Fairness does not cost throughput: the engine is never idle either way.
    assert sum(fair.values()) >= 0.95 * sum(fcfs.values())


def test_weights_divide_service_in_proportion():
    served = _flood("fair", weights={"loud": 3.0, "quiet": 1.0})
    assert 2.7 <= served["loud"] / served["quiet"] <= 3.3


def test_preemption_takes_the_victim_from_the_tenant_furthest_ahead():
    # 8 blocks of 4 tokens: two requests of 12 + output cannot both grow to completion.
    sched = _scheduler("fair", num_blocks=8, block_size=4, budget=64)
    sched.ledger.charge_prompt("ahead", 1000)  # this tenant has already been served a lot
    ahead, behind = _request("ahead", 12, 20), _request("behind", 12, 20)
    sched.add_request(behind)
    sched.add_request(ahead)
    preempted = []
    while sched.has_unfinished():
        preempted += _step(sched).preempted
    assert preempted and set(preempted) == {ahead.request_id}


def test_a_returning_tenant_banks_no_credit_for_its_idle_time():
    ledger = FairShareLedger()
    ledger.arrive("busy")
    ledger.charge_generated("busy", 500)
    ledger.arrive("idle")  # first request after a long absence: lifted to the lowest active counter
    assert ledger.counter("idle") == ledger.counter("busy") == 1000
    ledger.leave("busy")
    ledger.leave("idle")
    ledger.arrive("newcomer")  # the engine was idle: lifted to where the last active tenant stood
    assert ledger.counter("newcomer") == 1000


def test_priority_orders_before_fairness():
    sched = _scheduler("fair", budget=4)
    sched.ledger.charge_prompt("rich", 10_000)
    urgent = _request("rich", 4, 1, priority=0)
    sched.add_request(_request("poor", 4, 1, priority=1))
    sched.add_request(urgent)
    assert [s.request.request_id for s in _step(sched).scheduled] == [urgent.request_id]
