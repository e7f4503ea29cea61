"""The engine's Prometheus metrics (names and meanings from DESIGN.md "Contracts").

Latency histograms are observed by the server as outputs stream out. Counters and gauges are read
from the engine's stats snapshot at scrape time, so the engine loop never waits on the metrics.
Every series carries `model`, `tenant` and `service`; the operator sets the tenant and service
environment variables (flotilla.contract), and an unset one is exported as "" (which Prometheus treats
as no label). Names, labels and variables all come from flotilla.contract.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from flotilla.contract import (
    E2E_REQUEST_LATENCY,
    ENGINE_LABELS,
    ENV_SERVICE,
    ENV_TENANT,
    FINISH_REASONS,
    GENERATION_TOKENS,
    INTER_TOKEN_LATENCY,
    KV_CACHE_USAGE_RATIO,
    LABEL_FINISH_REASON,
    LABEL_MODEL,
    LABEL_SERVICE,
    LABEL_TENANT,
    NUM_PREEMPTIONS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
    TIME_TO_FIRST_TOKEN,
)
from flotilla.engine.core.outputs import EngineStats, RequestOutput

LABELS = ENGINE_LABELS
# 1 ms to 5 minutes: CPU-only tiny models answer in milliseconds, a loaded big model in minutes.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


def label_values(model: str) -> dict[str, str]:
    return {
        LABEL_MODEL: model,
        LABEL_TENANT: os.environ.get(ENV_TENANT, ""),
        LABEL_SERVICE: os.environ.get(ENV_SERVICE, ""),
    }


class _StatsCollector:
    """Turns an EngineStats snapshot into gauges and counters at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats | None], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self):
        stats = self._stats() or EngineStats()
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge(NUM_REQUESTS_RUNNING, "Requests in the running batch.", stats.num_running)
        yield gauge(
            NUM_REQUESTS_WAITING,
            "Requests queued, not yet scheduled (queue depth).",
            stats.num_waiting,
        )
        yield gauge(KV_CACHE_USAGE_RATIO, "Used KV blocks / all KV blocks.", stats.kv_cache_usage)
        yield counter(
            PREFIX_CACHE_QUERIES,
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield counter(PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        yield counter(PROMPT_TOKENS, "Prompt tokens processed.", stats.prompt_tokens)
        yield counter(GENERATION_TOKENS, "Tokens generated.", stats.generation_tokens)
        yield counter(NUM_PREEMPTIONS, "Sequences preempted.", stats.num_preemptions)
        finished = CounterMetricFamily(
            REQUEST_SUCCESS,
            "Finished requests by finish reason.",
            labels=[*names, LABEL_FINISH_REASON],
        )
        reasons = dict.fromkeys(FINISH_REASONS, 0) | stats.finished_by_reason
        for reason, count in sorted(reasons.items()):
            finished.add_metric([*values, reason], count)
        yield finished


class EngineMetrics:
    def __init__(self, model: str, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.labels = label_values(model)
        names = list(self.labels)

        def histogram(name: str, doc: str) -> Histogram:
            metric = Histogram(name, doc, names, buckets=LATENCY_BUCKETS, registry=self.registry)
            return metric.labels(**self.labels)

        self.ttft = histogram(TIME_TO_FIRST_TOKEN, "Arrival to first generated token, in seconds.")
        self.itl = histogram(INTER_TOKEN_LATENCY, "Gap between consecutive tokens of a request, in seconds.")
        self.e2e = histogram(E2E_REQUEST_LATENCY, "Arrival to last token, in seconds.")
        self.registry.register(_StatsCollector(stats, self.labels))


class RequestTimer:
    """Observes one engine request's latencies from the timestamps on its outputs."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self._last_token_time: float | None = None

    def observe(self, out: RequestOutput) -> None:
        if out.new_token_ids and out.last_token_time is not None:
            if self._last_token_time is None:
                if out.first_token_time is not None:
                    self.metrics.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
            else:
                self.metrics.itl.observe(max(0.0, out.last_token_time - self._last_token_time))
            self._last_token_time = out.last_token_time
        if out.finished and out.finish_reason != "abort" and out.last_token_time is not None:
            self.metrics.e2e.observe(max(0.0, out.last_token_time - out.arrival_time))
