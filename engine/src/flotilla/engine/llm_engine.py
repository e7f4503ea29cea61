"""LLMEngine: the synchronous core. add_request / step / abort, plus generate() for offline batches.

Each step: the scheduler picks a batch, the model runner runs it and samples (or verifies drafts), the
scheduler appends the tokens and applies length/eos stops, and the output processor
(text/output_processor.py) detokenizes, applies stop strings and builds the outputs; the engine then
finishes, in the scheduler, the requests a stop string ended. With speculative decoding it ends the step
by proposing the next step's drafts for the decoding requests (n-gram lookup or the draft model), in
slots the scheduler reserves. Not thread-safe: AsyncEngine drives it from one worker thread.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from flotilla.contract import FLAG_ENABLE_LORA, root_block_hash
from flotilla.engine.config import EngineConfig
from flotilla.engine.core.fair_share import FairShareConfig
from flotilla.engine.core.kv_cache_manager import KVCacheManager
from flotilla.engine.core.ngram_proposer import NgramProposer
from flotilla.engine.core.outputs import (
    EngineStats,
    LoRAStats,
    ModelInfo,
    RequestOutput,
    SpecDecodeStats,
    TenantStats,
)
from flotilla.engine.core.request import FinishReason, Request
from flotilla.engine.core.resolved import Resolved
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.core.scheduler import Scheduler, SchedulerConfig
from flotilla.engine.lora.errors import LoRAError, LoRAInUse, UnknownLoRA
from flotilla.engine.lora.source import AdapterSources
from flotilla.engine.text.output_processor import OutputProcessor
from flotilla.engine.worker.model_files import ModelFiles


class LLMEngine:
    def __init__(self, config: EngineConfig, files: ModelFiles | None = None) -> None:
        from flotilla.engine.worker.model_runner import ModelRunner  # torch

        self.config = config
        files = files or ModelFiles.load(config)
        self.model_config = files.model_config
        self.tokenizer = files.tokenizer
        self.runner = ModelRunner(config, self.model_config, files.draft_config)
        # What the runner decided as it loaded: every reader below (and above) takes it from here.
        self.resolved: Resolved = self.runner.resolved
        self.proposer = self.runner.drafter or (
            NgramProposer() if config.speculative_method == "ngram" else None
        )
        # Every draft position has a counter from the start, so its series exists before the first draft.
        self.spec_stats = SpecDecodeStats(
            accepted_per_position=[0] * config.num_speculative_tokens if config.speculates else []
        )
        resolved = self.resolved
        self.kv_manager = KVCacheManager(resolved.num_blocks, resolved.block_size, resolved.prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                resolved.max_model_len,
                policy=config.scheduling_policy,
                fair_share=FairShareConfig(tenant_weights=dict(config.tenant_weights)),
                max_loras=config.max_loras if config.enable_lora else 0,
            ),
            self.kv_manager,
        )
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        gen_eos = self.tokenizer.generation_config.get("eos_token_id")
        eos.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        self.eos_token_ids = frozenset(eos)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._num_steps = 0
        # LoRA adapters in host memory (None: --enable-lora is off); the runner owns them with the slots.
        self.loras = self.runner.loras
        self.lora_stats: dict[str, LoRAStats] = {}
        # Where a lora_path that is an hf:// or http(s):// URI is fetched to (lora/source.py).
        self.lora_sources = AdapterSources(Path(config.lora_cache_dir) if config.lora_cache_dir else None)
        for name, path in config.lora_modules.items():
            self.load_lora(name, path)

    @property
    def max_model_len(self) -> int:
        return self.resolved.max_model_len

    @property
    def model_info(self) -> ModelInfo:
        return self.resolved.model_info

    # -- requests ------------------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """generation_config.json's values, where it has them."""
        gen = self.tokenizer.generation_config
        values = {}
        for ours, theirs in (
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
            ("min_p", "min_p"),
            ("repetition_penalty", "repetition_penalty"),
            ("max_tokens", "max_new_tokens"),
        ):
            if gen.get(theirs) is not None:
                values[ours] = gen[theirs]
        if gen.get("do_sample") is False:
            values["temperature"] = 0.0
        return SamplingParams(**values)

    def create_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        tenant: str = "",
        lora_name: str | None = None,
    ) -> Request:
        """Tokenizes and validates a request without queueing it (safe to call from any thread)."""
        self.check_lora(lora_name)
        arrival_time = arrival_time if arrival_time is not None else time.time()
        params = params or self.default_sampling_params()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        vocab = self.resolved.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        self.resolved.check_prompt(len(prompt_ids))
        return Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            priority=priority,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time,
            tenant=tenant,
            lora_name=lora_name or None,
        )

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        tenant: str = "",
        lora_name: str | None = None,
    ) -> Request:
        request = self.create_request(prompt, params, request_id, priority, arrival_time, tenant, lora_name)
        self.add_created_request(request)
        return request

    def add_created_request(self, request: Request) -> None:
        self.check_lora(request.lora_name)
        self.scheduler.add_request(request)
        self.output_processor.add_request(request)

    def abort(self, request_id: str) -> bool:
        """Drops a request (its client went away); its KV blocks are freed at once."""
        request = self.scheduler.finish_request(request_id, FinishReason.ABORT)
        self.output_processor.abort(request_id, was_unfinished=request is not None)
        self._forget(request_id)
        return request is not None

    def _forget(self, request_id: str) -> None:
        self.runner.sampler.forget(request_id)
        if self.proposer is not None:  # the n-gram index, or the draft model's last distributions
            self.proposer.forget(request_id)

    # -- LoRA adapters ---------------------------------------------------------------------------------
    def check_lora(self, lora_name: str | None) -> None:
        """Refuses a request for an adapter that is not loaded (or any adapter when LoRA is off)."""
        if not lora_name:
            return
        if self.loras is None:
            raise LoRAError(
                f"LoRA adapter {lora_name!r}: this engine serves none ({FLAG_ENABLE_LORA} is off)", "model"
            )
        if lora_name not in self.loras:
            raise UnknownLoRA(lora_name)

    def load_lora(self, name: str, path: str) -> None:
        """Reads, checks and registers a PEFT adapter folder (`path` a folder, or a URI fetched first:
        lora/source.py); a LoRAError says why not, and registers nothing."""
        if self.loras is None:
            raise LoRAError(f"cannot load {name!r}: {FLAG_ENABLE_LORA} is off", "lora_name")
        self.loras.check_new(name)  # before a fetch: a taken name costs no download
        self.loras.load(name, self.lora_sources.resolve(path))
        self.lora_stats[name] = LoRAStats()

    def lora_users(self, name: str) -> int:
        """Unfinished requests (waiting or running) that use the adapter."""
        return sum(1 for r in list(self.scheduler.requests.values()) if r.lora_name == name)

    def unload_lora(self, name: str) -> None:
        """Unregisters an adapter no unfinished request uses: its host weights, its device slot and the KV
        its requests left in the prefix cache all go. In use: LoRAInUse, and nothing changes."""
        if self.loras is None or name not in self.loras:
            raise UnknownLoRA(name)
        users = self.lora_users(name)
        if users:
            raise LoRAInUse(name, users)
        self.loras.remove(name)
        self.lora_stats.pop(name, None)
        if self.scheduler.lora_slots is not None:
            self.scheduler.lora_slots.forget(name)
        self.runner.forget_lora(name)
        self.kv_manager.pool.evict_chain(root_block_hash(name))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one iteration ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        result = self.runner.execute(sched)
        for item in sched.scheduled:
            if item.spec_token_ids and item.request.request_id in result.tokens:
                self.spec_stats.observe(
                    len(item.spec_token_ids), len(result.tokens[item.request.request_id]) - 1
                )
        now = time.time()
        self._num_steps += 1
        updated = self.scheduler.update_from_output(sched, result.tokens)
        if self.lora_stats:
            self._count_lora_usage(updated)
        processed = self.output_processor.process(
            [(request, tokens, result.logprobs.get(request.request_id)) for request, tokens in updated], now
        )
        for request_id in processed.stopped:
            self.scheduler.finish_request(request_id, FinishReason.STOP)
        for output in processed.outputs:
            if output.finished:
                self._forget(output.request_id)
        if self.proposer is not None:
            self._propose_drafts()
        return processed.outputs

    def _count_lora_usage(self, updated: list[tuple[Request, list[int]]]) -> None:
        for request, tokens in updated:
            stats = self.lora_stats.get(request.lora_name or "")
            if stats is not None:
                stats.generation_tokens += len(tokens)
                if request.is_finished:
                    stats.requests += 1
                    stats.prompt_tokens += request.num_prompt_tokens

    def _propose_drafts(self) -> None:
        """Drafts for the next step, for each decoding request that can use them, while the batch is small
        enough that verifying them is cheaper than what they save."""
        running = self.scheduler.running
        if len(running) > self.config.speculative_max_batch_size:
            return
        batch = []
        for request in running:
            params = request.sampling_params
            if not request.is_decoding or params.speculation_opt_out is not None:
                continue
            # The step after always adds one token of its own: drafts beyond max_tokens - 1 are wasted.
            room = self.config.num_speculative_tokens
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - request.num_output_tokens - 1)
            num_drafts = self.scheduler.reserve_draft_slots(request, room) if room > 0 else 0
            if num_drafts:
                batch.append((request, num_drafts))
        if batch:
            assert self.proposer is not None
            for (request, _k), drafts in zip(batch, self.proposer.propose(batch), strict=True):
                request.spec_token_ids = drafts

    # -- metrics -----------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot: counters since start and the current gauges. (The server reads it from the event
        loop while the worker thread steps, so it builds a fresh object and mutates nothing.)"""
        outputs = self.output_processor
        return EngineStats(
            prompt_tokens=outputs.prompt_tokens,
            generation_tokens=outputs.generation_tokens,
            prefix_cache_queries=self.kv_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_manager.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            finished_by_reason=dict(outputs.finished_by_reason),
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_manager.usage(),
            num_steps=self._num_steps,
            tenants=self._tenant_stats(),
            spec_decode=self.spec_stats.copy(),
            **self._lora_gauges(),
        )

    def _lora_gauges(self) -> dict:
        slots = self.scheduler.lora_slots
        if slots is None:
            return {}
        waiting = {r.lora_name for r in list(self.scheduler.waiting) if r.lora_name}
        return {
            "loras": {name: replace(s) for name, s in list(self.lora_stats.items())},
            "running_loras": slots.running_adapters(),
            "waiting_loras": sorted(waiting),
            "max_loras": slots.num_slots,
        }

    def _tenant_stats(self) -> dict[str, TenantStats]:
        """Each tenant's ledger entry and queued requests, copied. The worker thread may add a tenant or
        queue a request meanwhile: dict() and list() copy in one C call each, which no other Python
        thread interleaves with, and the copies are only read afterwards. The queue first: every tenant
        in it is then in the ledger, which only ever gains tenants."""
        waiting = Counter(request.tenant for request in list(self.scheduler.waiting))
        ledger = dict(self.scheduler.ledger.tenants)
        return {
            tenant: TenantStats(
                counter=service.counter,
                prompt_tokens=service.prompt_tokens,
                generation_tokens=service.generation_tokens,
                num_waiting=waiting[tenant],
            )
            for tenant, service in ledger.items()
        }

    # -- offline -----------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs a batch to completion; returns the final output of each prompt, in order."""
        from tqdm import tqdm

        if params is None or isinstance(params, SamplingParams):
            params = [params or self.default_sampling_params()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            ids.append(self.add_request(prompt, p).request_id)
        finals: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        finals[out.request_id] = out
                        bar.update(1)
        return [finals[i] for i in ids]
