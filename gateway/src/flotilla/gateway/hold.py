"""Requests held while a service has no ready replica (scale from zero, or a replica restarting).

One queue per service key (`namespace/name`), bounded: past `max_held` waiters a request is refused at
once rather than piling up behind a replica that may take minutes. A waiter ends one of four ways, each
its own type so the caller answers each differently: Ready (route it now), TimedOut (503), Refused (the
service cannot get a replica, e.g. quota: the message says why) or QueueFull (429/503 without waiting).
A waiter that is cancelled (its client went away) leaves the queue at once, freeing its place.

asyncio only, no I/O: whoever watches the pods calls release() when a replica becomes ready.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(frozen=True)
class Ready:
    pass


@dataclass(frozen=True)
class TimedOut:
    waited_seconds: float


@dataclass(frozen=True)
class Refused:
    message: str


@dataclass(frozen=True)
class QueueFull:
    max_held: int


HoldOutcome = Ready | TimedOut | Refused | QueueFull


class HoldQueue:
    """Futures per key, oldest first. One event loop only (the gateway's)."""

    def __init__(self, max_held: int) -> None:
        if max_held < 0:
            raise ValueError(f"max_held must be 0 or more, got {max_held}")
        self.max_held = max_held
        self._waiters: dict[str, list[asyncio.Future[Ready | Refused]]] = {}

    def held(self, key: str) -> int:
        return len(self._waiters.get(key, ()))

    def held_counts(self) -> dict[str, int]:
        """key -> waiters, for every key with any (the GATEWAY_HELD_REQUESTS gauge)."""
        return {key: len(waiters) for key, waiters in self._waiters.items() if waiters}

    async def hold(self, key: str, timeout: float) -> HoldOutcome:
        """Wait until release(key) or fail(key), at most `timeout` seconds."""
        waiters = self._waiters.setdefault(key, [])
        if len(waiters) >= self.max_held:
            self._drop_if_empty(key)
            return QueueFull(self.max_held)
        if timeout <= 0:
            self._drop_if_empty(key)
            return TimedOut(0.0)
        future: asyncio.Future[Ready | Refused] = asyncio.get_running_loop().create_future()
        waiters.append(future)
        try:
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            # The deadline may fire after a release set the result but before this task resumed: the
            # release wins, since the replica it announced is there.
            if future.done() and not future.cancelled():
                return future.result()
            return TimedOut(timeout)
        finally:
            self._remove(key, future)

    def release(self, key: str, limit: int | None = None) -> int:
        """Wake the oldest `limit` waiters of `key` (all when None) with Ready; how many were woken."""
        return self._wake(key, Ready(), limit)

    def release_all(self, key: str) -> int:
        return self._wake(key, Ready(), None)

    def fail(self, key: str, message: str) -> int:
        """Wake every waiter of `key` with Refused(message): the service will not get a replica."""
        return self._wake(key, Refused(message), None)

    def fail_everything(self, message: str) -> int:
        """Refuse every waiter of every key (the gateway is shutting down)."""
        return sum(self._wake(key, Refused(message), None) for key in list(self._waiters))

    def _wake(self, key: str, outcome: Ready | Refused, limit: int | None) -> int:
        """Set `outcome` on the oldest `limit` live waiters (one cancelled but not yet gone counts not)."""
        woken = 0
        waiters = self._waiters.get(key, [])
        while waiters and (limit is None or woken < limit):
            future = waiters.pop(0)
            if not future.done():
                future.set_result(outcome)
                woken += 1
        self._drop_if_empty(key)
        return woken

    def _remove(self, key: str, future: asyncio.Future[Ready | Refused]) -> None:
        waiters = self._waiters.get(key)
        if waiters is not None and future in waiters:
            waiters.remove(future)
        self._drop_if_empty(key)

    def _drop_if_empty(self, key: str) -> None:
        if not self._waiters.get(key):
            self._waiters.pop(key, None)
