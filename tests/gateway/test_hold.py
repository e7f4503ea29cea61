"""Held requests: released when a replica is ready, refused, timed out, bounded, and freed on cancel.

Each test runs its own event loop (asyncio.run; no pytest-asyncio). Waiters are started as tasks and the
test yields to the loop until they are queued: no wall-clock sleeps. Timeouts are upper bounds long
enough never to fire in a passing run, except in the timeout test, where firing is the point.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from flotilla.gateway.hold import HoldOutcome, HoldQueue, QueueFull, Ready, Refused, TimedOut

LONG = 30.0  # never reached: the test releases or fails first


async def queued(holds: HoldQueue, key: str, count: int) -> None:
    """Yield to the loop until `count` waiters are queued for `key`."""
    for _ in range(1000):
        if holds.held(key) == count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{holds.held(key)} held for {key}, expected {count}")


def run(coroutine: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coroutine)


def test_release_wakes_waiters_with_ready() -> None:
    async def main() -> None:
        holds = HoldQueue(max_held=4)
        tasks = [asyncio.create_task(holds.hold("ns/chat", LONG)) for _ in range(3)]
        other = asyncio.create_task(holds.hold("ns/other", LONG))
        await queued(holds, "ns/chat", 3)
        assert holds.held_counts() == {"ns/chat": 3, "ns/other": 1}
        assert holds.release("ns/chat") == 3
        assert await asyncio.gather(*tasks) == [Ready()] * 3
        assert holds.held("ns/chat") == 0 and holds.held("ns/other") == 1
        assert not other.done()
        assert holds.release_all("ns/other") == 1
        assert await other == Ready()
        assert holds.held_counts() == {}

    run(main())


def test_release_with_a_limit_wakes_the_oldest() -> None:
    async def main() -> None:
        holds = HoldQueue(max_held=4)
        first = asyncio.create_task(holds.hold("k", LONG))
        await queued(holds, "k", 1)
        second = asyncio.create_task(holds.hold("k", LONG))
        await queued(holds, "k", 2)
        assert holds.release("k", limit=1) == 1
        assert await first == Ready()
        assert not second.done() and holds.held("k") == 1
        holds.release("k")
        assert await second == Ready()

    run(main())


def test_fail_refuses_with_the_message() -> None:
    async def main() -> None:
        holds = HoldQueue(max_held=2)
        tasks = [asyncio.create_task(holds.hold("k", LONG)) for _ in range(2)]
        await queued(holds, "k", 2)
        assert holds.fail("k", "tenant quota admits no replica") == 2
        outcomes: list[HoldOutcome] = await asyncio.gather(*tasks)
        assert outcomes == [Refused("tenant quota admits no replica")] * 2
        assert holds.held("k") == 0

    run(main())


def test_fail_everything_refuses_every_key() -> None:
    async def main() -> None:
        holds = HoldQueue(max_held=2)
        tasks = [asyncio.create_task(holds.hold(key, LONG)) for key in ("a", "b")]
        await queued(holds, "a", 1)
        await queued(holds, "b", 1)
        assert holds.fail_everything("shutting down") == 2
        assert await asyncio.gather(*tasks) == [Refused("shutting down")] * 2

    run(main())


def test_timeout() -> None:
    async def main() -> None:
        holds = HoldQueue(max_held=1)
        assert await holds.hold("k", 0.01) == TimedOut(0.01)
        assert holds.held("k") == 0  # the timed-out waiter left
        assert await holds.hold("k", 0) == TimedOut(0.0)

    run(main())


def test_queue_full_beyond_max_held() -> None:
    async def main() -> None:
        holds = HoldQueue(max_held=2)
        tasks = [asyncio.create_task(holds.hold("k", LONG)) for _ in range(2)]
        await queued(holds, "k", 2)
        assert await holds.hold("k", LONG) == QueueFull(2)
        assert holds.held("k") == 2  # the refused one took no place
        assert await holds.hold("other", 0.001) == TimedOut(0.001)  # other keys have their own places
        holds.release("k")
        await asyncio.gather(*tasks)
        assert await HoldQueue(max_held=0).hold("k", LONG) == QueueFull(0)

    run(main())


def test_cancelled_waiter_frees_its_place() -> None:
    async def main() -> None:
        holds = HoldQueue(max_held=1)
        gone = asyncio.create_task(holds.hold("k", LONG))
        await queued(holds, "k", 1)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert holds.held("k") == 0 and holds.held_counts() == {}
        # The place is free again, and a release wakes the new waiter, not the cancelled one.
        replacement = asyncio.create_task(holds.hold("k", LONG))
        await queued(holds, "k", 1)
        assert holds.release("k") == 1
        assert await replacement == Ready()

    run(main())


def test_release_skips_a_waiter_cancelled_but_not_yet_gone() -> None:
    async def main() -> None:
        holds = HoldQueue(max_held=2)
        gone = asyncio.create_task(holds.hold("k", LONG))
        await queued(holds, "k", 1)
        waiting = asyncio.create_task(holds.hold("k", LONG))
        await queued(holds, "k", 2)
        gone.cancel()  # its cleanup has not run yet: the release comes first
        assert holds.release("k", limit=1) == 1
        assert await waiting == Ready()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert holds.held("k") == 0

    run(main())


def test_negative_max_held_is_refused() -> None:
    with pytest.raises(ValueError):
        HoldQueue(max_held=-1)
