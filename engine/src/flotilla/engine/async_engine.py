"""AsyncEngine: drives an LLMEngine from one worker thread so an asyncio server stays responsive.

The thread is dedicated and long-lived, never a pool's: torch's CPU kernels keep an OpenMP thread team
per calling thread, so steps hopping across pool threads would start teams that spin against each other.

Callers on the event loop create requests (tokenized and validated at once, so bad input raises in
the caller), and iterate their outputs with `async for`. Adds and aborts are queued and applied by the
worker between steps; leaving the `async for` early (client gone, task cancelled) aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from flotilla.engine.core.outputs import EngineStats, RequestOutput
from flotilla.engine.core.request import Request
from flotilla.engine.core.resolved import Resolved
from flotilla.engine.core.sampling_params import SamplingParams
from flotilla.engine.llm_engine import LLMEngine
from flotilla.engine.lora.errors import LoRAInUse
from flotilla.engine.text.tokenizer import ModelTokenizer


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._to_add: list[Request] = []
        self._to_abort: list[str] = []
        self._queues: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flotilla-engine")

    # What a server may read of the engine: the tokenizer, the values resolved when the model loaded, the
    # sampling defaults of generation_config.json, and (below) its counters and whether its loop is alive.
    @property
    def tokenizer(self) -> ModelTokenizer:
        return self.engine.tokenizer

    @property
    def resolved(self) -> Resolved:
        return self.engine.resolved

    def default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def start(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="flotilla-engine")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._thread.shutdown(wait=True)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def error(self) -> BaseException | None:
        """Why the engine loop died; None while it is alive. (The server's /health reads it.)"""
        return self._error

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        tenant: str = "",
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs (new tokens and text each step) until it finishes.
        arrival_time: when the request reached the server (TTFT counts from it); default now.
        tenant: who it is served for (the fair policy's unit). lora_name: its adapter (None: the base)."""
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error!r}")
        self.start()
        request = self.engine.create_request(
            prompt, params, request_id, priority, arrival_time, tenant, lora_name
        )
        rid = request.request_id
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in use")
        with self._lock:
            # Under the lock an unload waits for: the adapter cannot go between this check and the add.
            self.engine.check_lora(request.lora_name)
            self._to_add.append(request)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        assert self._wakeup is not None
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item!r}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    # -- LoRA adapters: loaded and unloaded on the engine's thread, between two steps ---------------------
    @property
    def lora_enabled(self) -> bool:
        return self.engine.loras is not None

    def lora_names(self) -> list[str]:
        return [name for name, _path in self.lora_adapters()]

    def lora_adapters(self) -> list[tuple[str, str]]:
        """(name, folder) of each loaded adapter, in load order (one copy: loads run on another thread)."""
        loras = self.engine.loras
        return [] if loras is None else [(name, a.path) for name, a in list(loras.adapters.items())]

    async def load_lora(self, name: str, path: str) -> None:
        """Reads, checks and registers an adapter (a LoRAError says why not; nothing is registered). A `path`
        that is a URI is fetched first on a thread of its own (lora/source.py), so that steps go on meanwhile;
        the engine's thread then reads the fetched folder."""
        loop = asyncio.get_running_loop()
        if self.engine.loras is not None:
            self.engine.loras.check_new(name)  # a taken name or a full registry costs no download
            await loop.run_in_executor(None, self.engine.lora_sources.resolve, path)
        await loop.run_in_executor(self._thread, self.engine.load_lora, name, path)

    async def unload_lora(self, name: str) -> None:
        """Unregisters an adapter that no request uses, queued ones included (LoRAInUse otherwise)."""

        def check() -> None:  # under self._lock
            queued = sum(1 for r in self._to_add if r.lora_name == name)
            users = queued + self.engine.lora_users(name)
            if users and self.engine.loras is not None and name in self.engine.loras:
                raise LoRAInUse(name, users)

        def unload() -> None:
            with self._lock:  # no request for it can be queued meanwhile (generate checks under the lock)
                check()
                self.engine.unload_lora(name)

        # Refused at once while requests use it (without waiting for the engine's thread, which may be in
        # a long step); then unloaded on that thread, between two steps, after checking again.
        with self._lock:
            check()
        await asyncio.get_running_loop().run_in_executor(self._thread, unload)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._to_abort.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def _work(self) -> list[RequestOutput]:
        """Runs in the worker thread: apply queued adds/aborts, then one step."""
        with self._lock:
            adds, self._to_add = self._to_add, []
            aborts, self._to_abort = self._to_abort, []
        aborted = set(aborts)
        for request in adds:
            if request.request_id not in aborted:  # its client left before it was queued
                self.engine.add_created_request(request)
        for rid in aborts:
            self.engine.abort(rid)
        if not self.engine.has_unfinished_requests():
            return []
        return self.engine.step()

    def _has_work(self) -> bool:
        with self._lock:
            queued = bool(self._to_add or self._to_abort)
        return queued or self.engine.has_unfinished_requests()

    async def _run(self) -> None:
        assert self._wakeup is not None
        try:
            while True:
                if not self._has_work():
                    self._wakeup.clear()
                    if not self._has_work():
                        await self._wakeup.wait()
                outputs = await asyncio.get_running_loop().run_in_executor(self._thread, self._work)
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the engine is broken: fail every stream
            self._error = exc
            for queue in self._queues.values():
                queue.put_nowait(exc)
            raise
