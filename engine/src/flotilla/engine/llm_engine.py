"""LLMEngine: the synchronous core. add_request / step / abort, plus generate() for offline batches.

Each step: the scheduler picks a batch, the model runner runs it and samples, the scheduler appends
the tokens and applies length/eos stops, and the engine detokenizes incrementally and applies stop
strings. Not thread-safe: AsyncEngine drives it from one worker thread.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from flotilla.engine.config import EngineConfig
from flotilla.engine.core.kv_cache_manager import KVCacheManager
from flotilla.engine.core.outputs import EngineStats, RequestOutput, TokenLogprob
from flotilla.engine.core.request import FinishReason, Request
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.core.scheduler import Scheduler, SchedulerConfig
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.text.detokenizer import IncrementalDetokenizer
from flotilla.engine.text.tokenizer import ModelTokenizer


@dataclass
class _OutputState:
    detokenizer: IncrementalDetokenizer
    emitted_chars: int = 0
    num_emitted_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from flotilla.engine.worker.model_runner import ModelRunner  # torch

        self.config = config
        folder = Path(config.model)
        self.model_config = ModelConfig.from_file(folder / "config.json")
        self.tokenizer = ModelTokenizer(folder)
        self.runner = ModelRunner(config, self.model_config)
        self.max_model_len = self.runner.max_model_len
        self.kv_manager = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len),
            self.kv_manager,
        )
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        gen_eos = self.tokenizer.generation_config.get("eos_token_id")
        eos.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        self.eos_token_ids = frozenset(eos)
        self._states: dict[str, _OutputState] = {}
        self._ids = itertools.count()
        self._stats = EngineStats()

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
    ) -> Request:
        """Tokenizes and validates a request without queueing it (safe to call from any thread)."""
        arrival_time = arrival_time if arrival_time is not None else time.time()
        params = params or self.default_sampling_params()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_model_len} "
                "tokens, including at least one generated token"
            )
        return Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            priority=priority,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time,
        )

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        request = self.create_request(prompt, params, request_id, priority, arrival_time)
        self.add_created_request(request)
        return request

    def add_created_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        params = request.sampling_params
        self._states[request.request_id] = _OutputState(
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens),
            logprobs=[] if params.logprobs is not None else None,
        )

    def abort(self, request_id: str) -> bool:
        """Drops a request (its client went away); its KV blocks are freed at once."""
        request = self.scheduler.finish_request(request_id, FinishReason.ABORT)
        self._states.pop(request_id, None)
        self.runner.sampler.forget(request_id)
        if request is None:
            return False
        self._count_finish(FinishReason.ABORT)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one iteration ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        sample_requests, result = self.runner.execute(sched)
        sampled = {r.request_id: t for r, t in zip(sample_requests, result.token_ids, strict=True)}
        logprobs = {r.request_id: lp for r, lp in zip(sample_requests, result.logprobs, strict=True)}
        now = time.time()
        self._stats.num_steps += 1
        outputs = []
        for request, token in self.scheduler.update_from_output(sched, sampled):
            outputs.append(self._make_output(request, token, logprobs[request.request_id], now))
        return outputs

    def _make_output(self, request: Request, token: int, logprob, now: float) -> RequestOutput:
        state = self._states[request.request_id]
        params = request.sampling_params
        stats = self._stats
        if request.first_token_time is None:
            request.first_token_time = now
            stats.prompt_tokens += request.num_prompt_tokens
        request.last_token_time = now
        stats.generation_tokens += 1
        if logprob is not None and state.logprobs is not None:
            state.logprobs.append(TokenLogprob(token, logprob[0], logprob[1]))

        detok = state.detokenizer
        detok.add(token)
        if params.stop and not request.is_finished and request.num_output_tokens >= params.min_tokens:
            window = len(detok.text) - (max(map(len, params.stop)) + 8)
            hit = _find_stop(detok.text, params.stop, max(window, state.emitted_chars, 0))
            if hit is not None:
                detok.text = detok.text[:hit]
                self.scheduler.finish_request(request.request_id, FinishReason.STOP)
        elif request.is_finished:
            detok.flush()

        finished = request.is_finished
        text = detok.text
        limit = len(text)
        if params.stop and not finished:
            # Hold back what could be the start of a stop string.
            limit = max(state.emitted_chars, limit - (max(map(len, params.stop)) - 1))
        new_text = text[state.emitted_chars : limit]
        state.emitted_chars = limit
        new_ids = request.output_token_ids[state.num_emitted_tokens :]
        state.num_emitted_tokens = request.num_output_tokens
        new_logprobs = None
        if state.logprobs is not None:
            new_logprobs = state.logprobs[-len(new_ids) :] if new_ids else []
        output = RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=request.finish_reason.value if finished and request.finish_reason else None,
            logprobs=new_logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            last_token_time=request.last_token_time,
        )
        if finished:
            output.text = text
            output.token_ids = list(request.output_token_ids)
            output.all_logprobs = state.logprobs
            self._states.pop(request.request_id, None)
            self.runner.sampler.forget(request.request_id)
            self._count_finish(request.finish_reason)
        return output

    def _count_finish(self, reason: FinishReason | None) -> None:
        key = reason.value if reason else "unknown"
        self._stats.finished_by_reason[key] = self._stats.finished_by_reason.get(key, 0) + 1

    # -- metrics -----------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot: counters since start and the current gauges."""
        s = self._stats
        s.prefix_cache_queries = self.kv_manager.prefix_cache_queries
        s.prefix_cache_hits = self.kv_manager.prefix_cache_hits
        s.num_preemptions = self.scheduler.num_preemptions
        s.num_running = self.scheduler.num_running
        s.num_waiting = self.scheduler.num_waiting
        s.kv_cache_usage = self.kv_manager.usage()
        snapshot = EngineStats(**{f.name: getattr(s, f.name) for f in fields(s)})
        snapshot.finished_by_reason = dict(s.finished_by_reason)
        return snapshot

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


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    best = None
    for stop in stops:
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best):
            best = i
    return best
