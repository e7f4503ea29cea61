"""Answers an admitted engine job: a JSON body, or an SSE stream. Either way its queue slot is
released exactly once, and a client that leaves aborts its engine requests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from flotilla.disconnect import ClientDisconnected, until_disconnected
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
        return JSONResponse(await until_disconnected(body(), request.receive))
    except ClientDisconnected:  # its engine requests were aborted with the cancelled body
        raise ApiError(499, "the client closed the connection", code="client_closed") from None
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
