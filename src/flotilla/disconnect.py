"""Waiting for something on a client's behalf while watching whether the client is still there.

The engine's server (a non-streaming answer: cancelling it aborts its engine requests) and the gateway (a
replica to come up, the upstream call, its body) both race the work against the client's disconnect. Both
call `until_disconnected` with the request's ASGI `receive` callable: duck-typed, asyncio and the standard
library only, so the root distribution needs no web framework (starlette's `request.receive` is one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

Receive = Callable[[], Awaitable[Mapping[str, Any]]]


class ClientDisconnected(Exception):
    """The client disconnected before the work it waited for was done; the work was cancelled."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the ASGI `receive` says the client is gone (its body has been read by then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(
    work: Awaitable[T],
    receive: Receive,
    discard: Callable[[T], Awaitable[object]] | None = None,
) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled and
    ClientDisconnected raised. `discard` releases a result that `work` produced anyway, between the
    disconnect and its cancellation (an open upstream response, say). Whatever happens, neither `work` nor
    the watch outlives the call."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # nobody is left to tell
            result = await task
            if discard is not None:
                await discard(result)
        raise ClientDisconnected
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
