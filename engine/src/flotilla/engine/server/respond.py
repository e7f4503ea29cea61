"""Answers an admitted engine job: a JSON body, or an SSE stream. Either way its queue slot is
released exactly once, and a client that leaves aborts its engine requests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from flotilla.engine.async_engine import EngineDeadError
from flotilla.engine.server.errors import ApiError
from flotilla.engine.server.gate import Gate
from flotilla.engine.server.openai_serving import Job


async def respond(
    request: Request,
    gate: Gate,
    job: Job,
    body: Callable[[], Awaitable[dict]],
    events: AsyncIterator[str],
) -> Response:
    release = gate.admit(job)
    if job.stream:
        return _TrackedStream(events, release, media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
    try:
        return JSONResponse(await _until_disconnect(request, body()))
    except EngineDeadError as exc:
        raise ApiError(500, f"the engine failed: {exc}", code="engine_error") from exc
    finally:
        release()


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


async def _until_disconnect(request: Request, work: Awaitable):
    """Awaits `work`, cancelling it (and so aborting its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ApiError(499, "the client closed the connection", code="client_closed")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
