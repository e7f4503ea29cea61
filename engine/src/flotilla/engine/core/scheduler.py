"""Iteration-level scheduler: each step picks which requests run and how many tokens each computes.

There are no prefill and decode phases. Every running request's computed tokens catch up with its known
tokens (prompt + outputs) under a per-step token budget, so a long prompt is prefilled in chunks while
other requests keep decoding in the same step. Running requests are served first, in the policy's order
(policy.py: fcfs, priority or tenant-fair); when the KV pool runs dry the last of that order is preempted
(its blocks freed, recomputed later). Waiting requests are admitted in the policy's order only in steps
that preempted nothing. Plain Python, no torch.

Speculative decoding adds no phase either: a decoding request that carries draft tokens (proposed after
the previous step, their KV slots already reserved by reserve_draft_slots) computes its last token and
the drafts in one chunk, and the model returns 1..K+1 verified tokens. Its computed tokens then stop at
the verified ones and the blocks past them go back to the pool (the rejected drafts' KV is rolled back);
only blocks full of verified tokens are ever registered in the prefix cache.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from flotilla.contract import SCHEDULING_FCFS
from flotilla.engine.core.fair_share import FairShareConfig, FairShareLedger
from flotilla.engine.core.kv_cache_manager import KVCacheManager
from flotilla.engine.core.lora_slots import NO_SLOT, LoRASlots
from flotilla.engine.core.policy import SchedulingPolicy
from flotilla.engine.core.request import FinishReason, Request, RequestStatus
from flotilla.engine.core.resolved import check_context_length


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = SCHEDULING_FCFS  # one of SCHEDULING_POLICIES (policy.py)
    fair_share: FairShareConfig = field(default_factory=FairShareConfig)
    max_loras: int = 0  # LoRA adapters' device slots (lora_slots.py); 0: the base model only

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # Tokens with KV already in the cache before this step (the chunk starts here).
    num_computed_tokens: int
    # True when this chunk reaches the end of the known tokens, so its last logits pick a token.
    samples: bool = False
    # Draft tokens verified in this step; they are the last len(spec_token_ids) of the num_new_tokens.
    spec_token_ids: list[int] = field(default_factory=list)
    # The device slot of the request's LoRA adapter (NO_SLOT: the base model).
    lora_slot: int = NO_SLOT

    @classmethod
    def of(
        cls,
        request: Request,
        num_new_tokens: int,
        num_computed_tokens: int,
        spec_token_ids: list[int] | None = None,
        lora_slot: int = NO_SLOT,
    ) -> ScheduledRequest:
        spec = spec_token_ids or []
        samples = num_computed_tokens + num_new_tokens - len(spec) == request.num_tokens
        return cls(request, num_new_tokens, num_computed_tokens, samples, spec, lora_slot)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.requests: dict[str, Request] = {}
        self.ledger = FairShareLedger(config.fair_share)
        self.policy = SchedulingPolicy(config.policy, self.ledger)
        self._queue_key = self.policy.queue_key()
        self._running_key = self.policy.running_key()
        # Both queues are kept in the policy's order.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.lora_slots = LoRASlots(config.max_loras) if config.max_loras else None

    # -- queue bookkeeping -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_context_length(request.num_tokens, self.config.max_model_len)
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.ledger.arrive(request.tenant)
        bisect.insort(self.waiting, request, key=self._queue_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish or abort a request; its blocks go back to the pool at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._release_lora(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        self.ledger.leave(request.tenant)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return request

    def _release_lora(self, request: Request) -> None:
        if self.lora_slots is not None:
            self.lora_slots.release(request.lora_name)

    def _lora_slot(self, request: Request) -> int:
        return NO_SLOT if self.lora_slots is None else self.lora_slots.slot_of(request.lora_name)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_lora(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_draft_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        # It keeps its original arrival, so it goes back ahead of everyone who came after it.
        bisect.insort(self.waiting, request, key=self._queue_key)

    # -- one step ------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.policy.reorders_running:
            self.running.sort(key=self._running_key)  # counters moved since the last step

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            spec = self._drafts_to_verify(request, budget)
            num_new += len(spec)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running[-1]  # last in the policy's order
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(
                    ScheduledRequest.of(
                        request, num_new, request.num_computed_tokens, spec, self._lora_slot(request)
                    )
                )
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: everything after it is gone too

        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _drafts_to_verify(self, request: Request, budget: int) -> list[int]:
        """The request's drafts that fit this step's budget and the context (a draft at position p needs
        p < max_model_len); the request keeps none of them: the next proposal replaces them."""
        spec, request.spec_token_ids = request.spec_token_ids, []
        if not spec or not request.is_decoding:
            return []
        room = min(budget - 1, self.config.max_model_len - request.num_tokens)
        return spec[: max(room, 0)]

    def reserve_draft_slots(self, request: Request, num_drafts: int) -> int:
        """Reserves KV slots for a decoding request's next token and up to num_drafts drafts after it, so
        that the draft model can write its KV there and the next step verifies without allocating. Returns
        how many drafts fit: fewer near the context's end, none when the pool is short (speculation never
        preempts)."""
        if request.status != RequestStatus.RUNNING or not request.is_decoding:
            return 0
        num_drafts = min(num_drafts, self.config.max_model_len - request.num_tokens)
        # Lookahead, not new: nothing is computed before the next step, so nothing is registered yet.
        if num_drafts < 1 or not self.kv.allocate_slots(request, 0, num_lookahead_tokens=1 + num_drafts):
            return 0
        return num_drafts

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            index = self._pick_waiting()
            if index is None:
                break  # every waiting request's adapter waits for a slot
            request = self.waiting[index]
            hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(request, num_new, hit_blocks):
                break  # the policy's next request waits for blocks, which keeps the policy's order
            self.waiting.pop(index)
            self.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit_tokens
                self.ledger.charge_prompt(request.tenant, request.num_prompt_tokens)
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._running_key)
            slot = NO_SLOT if self.lora_slots is None else self.lora_slots.acquire(request.lora_name)
            out.scheduled.append(ScheduledRequest.of(request, num_new, num_hit_tokens, lora_slot=slot))
            budget -= num_new

    def _pick_waiting(self) -> int | None:
        """The policy's pick among the waiting requests that may run now: with LoRA slots, a request whose
        adapter is in no slot while every slot is in use waits, and those behind it may go first."""
        if self.lora_slots is None:
            return self.policy.pick(self.waiting)
        slots = self.lora_slots
        eligible = [r for r in self.waiting if slots.can_run(r.lora_name)]
        if not eligible:
            return None
        if len(eligible) == len(self.waiting):
            return self.policy.pick(self.waiting)
        return self.waiting.index(eligible[self.policy.pick(eligible)])

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[tuple[Request, list[int]]]:
        """Advance computed tokens and append the sampled tokens: one per request that sampled, or, after
        verifying drafts, the accepted drafts and one more. Returns (request, tokens appended) for each
        request that sampled; tokens after a stop are dropped, and finished requests have already released
        their blocks."""
        results: list[tuple[Request, list[int]]] = []
        for item in out.scheduled:
            request = item.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted between schedule and update
            if not item.samples:
                request.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens
                continue
            tokens = sampled[request.request_id]
            num_rejected = len(item.spec_token_ids) - (len(tokens) - 1)
            request.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens - num_rejected
            # Drafts rejected, cut by the budget or never proposed in reserved slots: their blocks go back.
            self.kv.release_unverified(request)
            # The draft model's KV holds what it was fed, which is verified only up to here.
            request.num_draft_computed_tokens = min(
                request.num_draft_computed_tokens, request.num_computed_tokens
            )
            appended: list[int] = []
            for token in tokens:
                request.append_output_token(token)
                appended.append(token)
                self.ledger.charge_generated(request.tenant)
                reason = self._stop_reason(request, token)
                if reason is not None:
                    self.finish_request(request.request_id, reason)
                    break
            results.append((request, appended))
        return results

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                return FinishReason.STOP
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None
