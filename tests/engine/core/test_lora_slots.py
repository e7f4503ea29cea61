"""The scheduler's LoRA slots (core/lora_slots.py and the scheduler's admission): never more adapters
running than slots, a running adapter never evicted, the least recently used idle slot reused, and a
request waiting for a slot never holding back the requests behind it that can run."""

from __future__ import annotations

import pytest

from flotilla.engine.core.kv_cache_manager import KVCacheManager
from flotilla.engine.core.lora_slots import NO_SLOT, LoRASlots
from flotilla.engine.core.request import FinishReason, Request
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.core.scheduler import Scheduler, SchedulerConfig


def test_slots_are_shared_by_an_adapters_requests_and_reused_least_recently_used_first():
    slots = LoRASlots(2)
    assert slots.acquire(None) == NO_SLOT
    a = slots.acquire("a")
    assert slots.acquire("a") == a  # a second request of the same adapter shares the slot
    b = slots.acquire("b")
    assert {a, b} == {0, 1}
    assert not slots.can_run("c")  # both slots in use
    slots.release("a")
    assert not slots.can_run("c")  # a still has a running request
    slots.release("a")
    assert slots.can_run("c") and slots.can_run("a")
    slots.release("b")
    assert slots.acquire("c") == a  # a's slot was idle longest
    assert slots.slot_of("a") == NO_SLOT and slots.slot_of("b") == b  # b kept its weights: no copy to reuse
    assert slots.running_adapters() == ["c"]
    with pytest.raises(AssertionError):
        slots.forget("c")  # in use
    slots.release("c")
    slots.forget("c")
    assert slots.slot_of("c") == NO_SLOT


def make(prompt_len: int, lora: str | None, rid: str) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4), lora_name=lora)


def test_a_request_waiting_for_a_slot_lets_runnable_requests_behind_it_go_first():
    scheduler = Scheduler(SchedulerConfig(max_loras=1, max_model_len=64), KVCacheManager(64, 4))
    scheduler.add_request(make(5, "a", "r1"))
    scheduler.add_request(make(5, "b", "r2"))  # b has no slot while a runs
    scheduler.add_request(make(5, None, "r3"))  # the base needs none
    scheduler.add_request(make(5, "a", "r4"))  # a's slot is shared
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r1", "r3", "r4"]
    assert [s.lora_slot for s in out.scheduled] == [0, NO_SLOT, 0]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    for rid in ("r1", "r4"):
        scheduler.finish_request(rid, FinishReason.STOP)
    out = scheduler.schedule()
    assert "r2" in [s.request.request_id for s in out.scheduled]
    assert scheduler.lora_slots is not None and scheduler.lora_slots.contents == ["b"]


def test_preemption_and_aborts_give_slots_back():
    scheduler = Scheduler(SchedulerConfig(max_loras=2, max_model_len=64), KVCacheManager(6, 4))
    for i, lora in enumerate(["a", "b", "a"]):
        scheduler.add_request(make(7, lora, f"r{i}"))
    scheduler.schedule()  # 6 blocks of 4 tokens: three 7-token prompts cannot all hold their KV
    slots = scheduler.lora_slots
    assert slots is not None
    running = {r.lora_name for r in scheduler.running}
    assert sum(slots.users) == len(scheduler.running) and set(slots.running_adapters()) == running
    for rid in list(scheduler.requests):
        scheduler.finish_request(rid, FinishReason.ABORT)
    assert not any(slots.users)
    assert scheduler.kv.pool.num_free_blocks == 6
