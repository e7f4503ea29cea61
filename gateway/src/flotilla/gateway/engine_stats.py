"""What the engines say about their load: each routable replica's waiting queue and KV-cache usage, read
from its /metrics about once a second. The picker combines them with the gateway's own in-flight counts,
which move at once; these lag by up to a poll."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from flotilla.contract import KV_CACHE_USAGE_RATIO, METRICS_PATH, NUM_REQUESTS_WAITING

log = logging.getLogger("flotilla.gateway.engine_stats")


def parse_engine_load(text: str) -> tuple[int, float]:
    """(requests waiting, KV-cache usage ratio) from an engine's exposition; sums over label sets."""
    waiting, usage = 0.0, 0.0
    for family in text_string_to_metric_families(text):
        if family.name == NUM_REQUESTS_WAITING:
            waiting += sum(s.value for s in family.samples)
        elif family.name == KV_CACHE_USAGE_RATIO:
            usage = max([usage, *(s.value for s in family.samples)])
    return int(waiting), float(usage)


class EngineStats:
    """Polls every endpoint `endpoints()` names; `load(url)` is the last reading (0, 0.0 before one)."""

    def __init__(self, endpoints: Callable[[], Iterable[str]], period: float = 1.0) -> None:
        self.endpoints, self.period = endpoints, period
        self.readings: dict[str, tuple[int, float]] = {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(2.0))

    def load(self, url: str) -> tuple[int, float]:
        return self.readings.get(url, (0, 0.0))

    async def poll_once(self) -> None:
        urls = sorted(set(self.endpoints()))
        results = await asyncio.gather(*(self._read(url) for url in urls))
        self.readings = {url: reading for url, reading in zip(urls, results, strict=True) if reading}

    async def _read(self, url: str) -> tuple[int, float] | None:
        try:
            rsp = await self.client.get(url + METRICS_PATH)
            rsp.raise_for_status()
            return parse_engine_load(rsp.text)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("no metrics from %s: %s", url, exc)
            return None

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.period)

    async def close(self) -> None:
        await self.client.aclose()
