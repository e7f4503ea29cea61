"""What the two generation endpoints share (serving_completion.py, serving_chat.py): turning a checked
request into engine requests, running them, and answering in JSON or SSE.

A request becomes one engine request per choice (each prompt times `n`); they run concurrently and their
outputs are merged into one stream of (choice, output). Everything a client can get wrong is checked
before the request is admitted to the queue, so bad input is a clean 4xx that holds nothing, and never a
broken stream. Then the request is answered in the one form it asked for: a JSON body (the client leaving
aborts its engine requests: 499) or an SSE stream (an engine failure mid-stream is one error event). Either
way its queue slot is released exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from flotilla.disconnect import ClientDisconnected, until_disconnected
from flotilla.engine.async_engine import AsyncEngine, EngineDeadError
from flotilla.engine.core.outputs import RequestOutput, TokenLogprob
from flotilla.engine.core.resolved import ContextLengthError
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.server.errors import ApiError, bad_request
from flotilla.engine.server.metrics import EngineMetrics, RequestTimer
from flotilla.engine.server.protocol import MAX_N, _SamplingFields

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SAMPLING_OVERRIDES = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                      "repetition_penalty", "min_tokens")  # fmt: skip


@dataclass(frozen=True)
class Call:
    """A generation request as it passed the gate (gate.py): the HTTP request, whose `receive` tells when
    the client leaves; when it arrived (TTFT counts from then); whom it is served for (tenancy.py); and the
    queue, which admits its choices or refuses them with 429, and returns their release."""

    request: Request
    arrival: float
    tenant: str
    admit: Callable[[int], Callable[[], None]]
    lora_name: str | None = None  # the LoRA adapter the body's model names (None: the base model)


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
    lora_name: str | None = None  # its adapter; the responses' `model` is then the adapter's name


class OpenAIServing:
    """The base of one endpoint kind's serving object (vLLM's shape): a route parses the body and calls
    its one method, which checks the request, submits it and returns the response. What it reads of the
    engine (the tokenizer, the resolved values, the sampling defaults) is fixed when the model loads."""

    request_id_prefix: ClassVar[str]  # the response ids' prefix, e.g. "chatcmpl"

    def __init__(self, engine: AsyncEngine, metrics: EngineMetrics, model_name: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.resolved = engine.resolved
        self.defaults = engine.default_sampling_params()

    # -- checking ----------------------------------------------------------------------------------
    def _job(
        self,
        req: _SamplingFields,
        call: Call,
        prompts: list[list[int]],
        *,
        prompt_field: str,
        max_tokens: int | None,
        max_tokens_field: str,
        logprobs: int | None,
    ) -> Job:
        if req.logit_bias:
            raise bad_request("'logit_bias' is not supported", param="logit_bias")
        if len(prompts) * req.n > MAX_N:
            raise bad_request(
                f"{len(prompts)} prompts times n={req.n} is {len(prompts) * req.n} choices; "
                f"the limit is {MAX_N}",
                param="n",
            )
        for ids in prompts:
            try:
                self.resolved.check_prompt(
                    len(ids), max_tokens, prompt_field=prompt_field, max_tokens_field=max_tokens_field
                )
            except ContextLengthError as exc:
                raise bad_request(str(exc), param=exc.param, code="context_length_exceeded") from None
        vocab_size = self.resolved.vocab_size
        bad_stop = [t for t in req.stop_token_ids or [] if t >= vocab_size]
        if bad_stop:
            raise bad_request(f"stop_token_ids {bad_stop[:5]} are outside the vocabulary", "stop_token_ids")
        overrides = {
            name: getattr(req, name) for name in SAMPLING_OVERRIDES if getattr(req, name) is not None
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
        return Job(
            request_id=f"{self.request_id_prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            arrival_time=call.arrival,
            choices=choices,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            num_prompt_tokens=sum(len(ids) for ids in prompts),
            tenant=call.tenant,
            lora_name=call.lora_name,
        )

    # -- answering ---------------------------------------------------------------------------------
    async def _respond(
        self,
        job: Job,
        call: Call,
        body: Callable[[], Awaitable[dict]],
        events: Callable[[], AsyncIterator[str]],
    ) -> Response:
        """Admits the job (429 when the queue is full), then answers it the one way it asked for."""
        release = call.admit(len(job.choices))
        if job.stream:
            try:
                head, rest = await until_disconnected(
                    _until_first_output(job, events()), call.request.receive
                )
            except ClientDisconnected:  # its engine requests were aborted with the cancelled events
                release()
                raise ApiError(499, "the client closed the connection", code="client_closed") from None
            except BaseException:
                release()
                raise
            return _TrackedStream(_chained(head, rest), release, media_type="text/event-stream",
                                  headers=SSE_HEADERS)  # fmt: skip
        try:
            return JSONResponse(await until_disconnected(body(), call.request.receive))
        except ClientDisconnected:  # its engine requests were aborted with the cancelled body
            raise ApiError(499, "the client closed the connection", code="client_closed") from None
        except EngineDeadError as exc:
            raise ApiError(500, f"the engine failed: {exc}", code="engine_error") from exc
        finally:
            release()

    async def _run(self, job: Job) -> AsyncIterator[tuple[Choice, RequestOutput]]:
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

    async def _run_to_end(self, job: Job) -> None:
        async for _ in self._run(job):
            pass

    async def _stream(self, job: Job, choice: Choice) -> AsyncIterator[RequestOutput]:
        timer = RequestTimer(self.metrics, job.tenant)
        stream = self.engine.generate(
            choice.prompt_ids,
            choice.params,
            f"{job.request_id}-{choice.index}",
            arrival_time=job.arrival_time,
            tenant=job.tenant,
            lora_name=job.lora_name,
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

    async def _guarded(self, parts: AsyncIterator) -> AsyncIterator:
        """Passes outputs through; an engine failure mid-stream becomes one SSE error event (the status
        line has long been sent)."""
        async with contextlib.aclosing(parts):
            try:
                async for part in parts:
                    yield part
            except EngineDeadError as exc:
                yield sse(ApiError(500, f"the engine failed: {exc}", code="engine_error").body())

    # -- formatting --------------------------------------------------------------------------------
    def _usage(self, job: Job) -> dict:
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

    def _body(self, job: Job, kind: str, choices: list[dict]) -> dict:
        return {"id": job.request_id, "object": kind, "created": job.created, "model": self._model(job),
                "choices": choices, "usage": self._usage(job)}  # fmt: skip

    def _chunk(self, job: Job, kind: str, choices: list[dict], usage: dict | None = None) -> str:
        """One SSE event of a stream; `usage` is present (null until the last) when the client asked."""
        body = {"id": job.request_id, "object": kind, "created": job.created, "model": self._model(job),
                "choices": choices}  # fmt: skip
        if job.include_usage:
            body["usage"] = usage
        return sse(body)

    def _model(self, job: Job) -> str:
        return job.lora_name or self.model_name

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


async def _until_first_output(job: Job, events: AsyncIterator[str]) -> tuple[list[str], AsyncIterator[str]]:
    """A stream's events up to the engine's first output (a token, a finish or an error), and the rest.

    Why the response waits for it: until its first bytes, an HTTP response can still be retried elsewhere by
    whatever carries it (Envoy retries an engine that resets or dies before answering), so an engine that
    dies while the request waits in its queue costs the client nothing. A response that had already sent
    its status line and the role chunk could only fail."""
    head: list[str] = []
    try:
        while not any(c.num_tokens or c.finish_reason for c in job.choices):
            try:
                head.append(await anext(events))
            except StopAsyncIteration:
                break
            if head[-1].startswith('data: {"error"'):  # an engine failure, as one event: send it
                break
    except BaseException:
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]  (an async generator's: aborts its requests)
        raise
    return head, events


async def _chained(head: list[str], rest: AsyncIterator[str]) -> AsyncIterator[str]:
    for part in head:
        yield part
    async with contextlib.aclosing(rest):  # type: ignore[type-var]
        async for part in rest:
            yield part


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class _TrackedStream(StreamingResponse):
    """A streaming response that always releases its queue slot, even when the client left before the
    body started (then the body generator never runs, so its own `finally` cannot)."""

    def __init__(self, content, release: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            aclose = getattr(self.body_iterator, "aclose", None)  # an async generator's; aborts the
            if aclose is not None:  # engine requests if it had started
                with contextlib.suppress(Exception):
                    await aclose()
