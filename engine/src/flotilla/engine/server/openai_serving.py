"""From OpenAI requests to engine requests and back.

A request becomes one engine request per choice (each prompt times `n`); they run concurrently and
their outputs are merged into one stream of (choice index, output). Everything a client can get wrong
is checked here, before any response starts, so bad input is a clean 4xx and never a broken stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from flotilla.engine.async_engine import AsyncEngine, EngineDeadError
from flotilla.engine.core.outputs import RequestOutput, TokenLogprob
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.server.errors import ApiError, bad_request
from flotilla.engine.server.metrics import EngineMetrics, RequestTimer
from flotilla.engine.server.protocol import MAX_N, ChatCompletionRequest, CompletionRequest, _SamplingFields
from flotilla.engine.text.tokenizer import plain_chat_messages


@dataclass
class Choice:
    """One engine request and what it has produced so far."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Job:
    """A validated request, ready to run."""

    request_id: str
    created: int
    arrival_time: float
    choices: list[Choice]
    stream: bool
    include_usage: bool
    num_prompt_tokens: int  # each prompt counted once, however many choices share it
    tenant: str = ""  # who it is served for (server/tenancy.py)


class Serving:
    def __init__(self, engine: AsyncEngine, metrics: EngineMetrics, model_name: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        llm = engine.engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = llm.max_model_len
        self.model_info = llm.model_info
        self.vocab_size = llm.model_config.vocab_size
        self.defaults = llm.default_sampling_params()

    # -- building jobs ---------------------------------------------------------------------------
    def completion_job(self, req: CompletionRequest, arrival_time: float, tenant: str = "") -> Job:
        if req.echo:
            raise bad_request("'echo' is not supported", param="echo")
        if req.suffix:
            raise bad_request("'suffix' is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("'best_of' is not supported (use n)", param="best_of")
        prompts = self._prompt_ids(req.prompt)
        return self._job(req, prompts, req.max_tokens, "max_tokens", req.logprobs, arrival_time, tenant)

    def chat_job(self, req: ChatCompletionRequest, arrival_time: float, tenant: str = "") -> Job:
        if req.tools:
            raise bad_request("'tools' are not supported", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request("only the 'text' response_format is supported", param="response_format")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt)
        max_tokens, name = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return self._job(req, [ids], max_tokens, name, logprobs, arrival_time, tenant)

    def chat_prompt_ids(self, messages, add_generation_prompt: bool) -> list[int]:
        plain = plain_chat_messages([m.model_dump() for m in messages])
        try:
            return self.tokenizer.encode_chat(plain, add_generation_prompt)
        except ValueError as exc:  # no chat template
            raise bad_request(str(exc), param="messages") from exc
        except Exception as exc:  # the template itself refused (raise_exception) or failed
            raise bad_request(f"the chat template failed on these messages: {exc}", param="messages") from exc

    def _prompt_ids(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str) or prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        out = []
        for p in prompts:
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise bad_request(
                    f"token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})", param="prompt"
                )
            if not ids:
                raise bad_request("the prompt has no tokens", param="prompt")
            out.append(ids)
        return out

    def _job(
        self,
        req: _SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        max_tokens_name: str,
        logprobs: int | None,
        arrival_time: float,
        tenant: str = "",
    ) -> Job:
        if req.logit_bias:
            raise bad_request("'logit_bias' is not supported", param="logit_bias")
        if len(prompts) * req.n > MAX_N:
            raise bad_request(
                f"{len(prompts)} prompts times n={req.n} is {len(prompts) * req.n} choices; "
                f"the limit is {MAX_N}",
                param="n",
            )
        limit = self.max_model_len
        for ids in prompts:
            if len(ids) >= limit:
                raise bad_request(
                    f"the prompt has {len(ids)} tokens; this model's context length is {limit} tokens, "
                    "and at least one token must be generated",
                    param="prompt" if isinstance(req, CompletionRequest) else "messages",
                    code="context_length_exceeded",
                )
            if max_tokens is not None and len(ids) + max_tokens > limit:
                raise bad_request(
                    f"the prompt has {len(ids)} tokens and {max_tokens_name} is {max_tokens}: "
                    f"{len(ids) + max_tokens} tokens, more than this model's context length of {limit}",
                    param=max_tokens_name,
                    code="context_length_exceeded",
                )
        bad_stop = [t for t in req.stop_token_ids or [] if t >= self.vocab_size]
        if bad_stop:
            raise bad_request(f"stop_token_ids {bad_stop[:5]} are outside the vocabulary", "stop_token_ids")
        overrides = {
            name: getattr(req, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "min_tokens",
            )
            if getattr(req, name) is not None
        }
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        choices = []
        for p, ids in enumerate(prompts):
            for j in range(req.n):
                seed = None if req.seed is None else req.seed + j  # n samples of one seed must differ
                try:
                    params = dataclasses.replace(
                        self.defaults,
                        **overrides,
                        seed=seed,
                        max_tokens=max_tokens,
                        stop=stop,
                        stop_token_ids=list(req.stop_token_ids or []),
                        ignore_eos=req.ignore_eos,
                        logprobs=logprobs,
                        skip_special_tokens=req.skip_special_tokens,
                    )
                except ValueError as exc:
                    raise bad_request(str(exc)) from exc
                choices.append(Choice(index=p * req.n + j, prompt_ids=ids, params=params))
        prefix = "chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl"
        return Job(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            arrival_time=arrival_time,
            choices=choices,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            num_prompt_tokens=sum(len(ids) for ids in prompts),
            tenant=tenant,
        )

    # -- running jobs ----------------------------------------------------------------------------
    async def run(self, job: Job) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Runs every choice of the job at once; yields each output as it comes, with its choice.
        Leaving early (client gone) aborts every engine request the job still has."""
        if len(job.choices) == 1:
            choice = job.choices[0]
            async with contextlib.aclosing(self._stream(job, choice)) as stream:
                async for out in stream:
                    yield choice, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async with contextlib.aclosing(self._stream(job, choice)) as stream:
                    async for out in stream:
                        queue.put_nowait((choice, out))
            except Exception as exc:
                queue.put_nowait((choice, exc))

        tasks = [asyncio.create_task(pump(c)) for c in job.choices]
        try:
            remaining = len(tasks)
            while remaining:
                choice, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield choice, item
                remaining -= item.finished
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stream(self, job: Job, choice: Choice) -> AsyncIterator[RequestOutput]:
        timer = RequestTimer(self.metrics, job.tenant)
        stream = self.engine.generate(
            choice.prompt_ids,
            choice.params,
            f"{job.request_id}-{choice.index}",
            arrival_time=job.arrival_time,
            tenant=job.tenant,
        )
        async with contextlib.aclosing(stream):
            async for out in stream:
                timer.observe(out)
                choice.text.append(out.new_text)
                choice.num_tokens = out.num_output_tokens
                choice.num_cached_tokens = out.num_cached_tokens
                if out.logprobs:
                    choice.logprobs.extend(out.logprobs)
                if out.finished:
                    choice.finish_reason = out.finish_reason
                yield out

    def usage(self, job: Job) -> dict:
        completion = sum(c.num_tokens for c in job.choices)
        seen, cached = set(), 0
        for c in job.choices:  # cached prompt tokens of each distinct prompt, once
            if id(c.prompt_ids) not in seen:
                seen.add(id(c.prompt_ids))
                cached += c.num_cached_tokens
        return {
            "prompt_tokens": job.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": job.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # -- formatting ------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, logprobs: list[TokenLogprob], want_top: bool, offset: int = 0) -> dict:
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in logprobs]
            if want_top
            else None,
            "text_offset": offsets,
        }

    def chat_logprobs(self, logprobs: list[TokenLogprob]) -> dict:
        def entry(token_id: int, value: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in logprobs
            ]
        }

    async def completion(self, job: Job, logprobs: int | None) -> dict:
        async for _ in self.run(job):
            pass
        choices = []
        for c in job.choices:
            entry = {
                "index": c.index,
                "text": "".join(c.text),
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
            if logprobs is not None:
                entry["logprobs"] = self.completion_logprobs(c.logprobs, logprobs > 0)
            choices.append(entry)
        return {
            "id": job.request_id,
            "object": "text_completion",
            "created": job.created,
            "model": self.model_name,
            "choices": choices,
            "usage": self.usage(job),
        }

    async def chat(self, job: Job, logprobs: bool) -> dict:
        async for _ in self.run(job):
            pass
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": self.chat_logprobs(c.logprobs) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in job.choices
        ]
        return {
            "id": job.request_id,
            "object": "chat.completion",
            "created": job.created,
            "model": self.model_name,
            "choices": choices,
            "usage": self.usage(job),
        }

    def chunk(self, job: Job, kind: str, choices: list[dict], usage: dict | None = None) -> str:
        """One SSE event of a stream; `usage` is present (null until the last) when the client asked."""
        body = {"id": job.request_id, "object": kind, "created": job.created, "model": self.model_name,
                "choices": choices}  # fmt: skip
        if job.include_usage:
            body["usage"] = usage
        return sse(body)

    async def completion_events(self, job: Job, logprobs: int | None) -> AsyncIterator[str]:
        offsets = dict.fromkeys(range(len(job.choices)), 0)
        chunk = functools.partial(self.chunk, job, "text_completion")

        failed = False
        async for part in self._guarded(self.run(job)):
            if isinstance(part, str):
                failed = True
                yield part
                continue
            choice, out = part
            if not (out.new_text or out.finished or (logprobs is not None and out.logprobs)):
                continue
            entry = {"index": choice.index, "text": out.new_text, "logprobs": None, "finish_reason": None}
            if logprobs is not None:
                entry["logprobs"] = self.completion_logprobs(
                    out.logprobs or [], logprobs > 0, offsets[choice.index]
                )
                offsets[choice.index] += len(out.new_text)
            if out.finished:
                entry["finish_reason"] = out.finish_reason
            yield chunk([entry])
        if job.include_usage and not failed:
            yield chunk([], self.usage(job))
        yield "data: [DONE]\n\n"

    async def chat_events(self, job: Job, logprobs: bool) -> AsyncIterator[str]:
        chunk = functools.partial(self.chunk, job, "chat.completion.chunk")

        yield chunk(
            [
                {
                    "index": c.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for c in job.choices
            ]
        )
        failed = False
        async for part in self._guarded(self.run(job)):
            if isinstance(part, str):
                failed = True
                yield part
                continue
            choice, out = part
            if out.new_text or (logprobs and out.logprobs):
                entry = {
                    "index": choice.index,
                    "delta": {"content": out.new_text},
                    "logprobs": None,
                    "finish_reason": None,
                }
                if logprobs:
                    entry["logprobs"] = self.chat_logprobs(out.logprobs or [])
                yield chunk([entry])
            if out.finished:
                yield chunk(
                    [
                        {
                            "index": choice.index,
                            "delta": {},
                            "logprobs": None,
                            "finish_reason": out.finish_reason,
                        }
                    ]
                )
        if job.include_usage and not failed:
            yield chunk([], self.usage(job))
        yield "data: [DONE]\n\n"

    async def _guarded(self, parts: AsyncIterator) -> AsyncIterator:
        """Passes outputs through; an engine failure mid-stream becomes one SSE error event (the status
        line has long been sent)."""
        async with contextlib.aclosing(parts):
            try:
                async for part in parts:
                    yield part
            except EngineDeadError as exc:
                yield sse(ApiError(500, f"the engine failed: {exc}", code="engine_error").body())


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"
