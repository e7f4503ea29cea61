"""The autoscaler's Prometheus series, served on the operator's /metrics (metrics.py's registry)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge

LABELS = ("namespace", "service")

DESIRED_REPLICAS = Gauge(
    "flotilla_autoscaler_desired_replicas", "Replicas the autoscaler decided on at its last decision", LABELS
)
TTFT_P95 = Gauge(
    "flotilla_autoscaler_ttft_p95_seconds", "Time to first token p95 over the service's TTFT window", LABELS
)
QUEUE_DEPTH = Gauge(
    "flotilla_autoscaler_queue_depth_per_replica", "Waiting requests per ready replica", LABELS
)
KV_USAGE = Gauge(
    "flotilla_autoscaler_kv_cache_usage_ratio", "Highest KV cache usage of the ready pods", LABELS
)
SCRAPE_FAILURES = Counter(
    "flotilla_autoscaler_scrape_failures", "Engine pod /metrics scrapes that failed", LABELS
)
SCALES = Counter("flotilla_autoscaler_scales", "Scale changes the autoscaler made", [*LABELS, "direction"])

_GAUGES = (DESIRED_REPLICAS, TTFT_P95, QUEUE_DEPTH, KV_USAGE)


def record(namespace: str, service: str, desired: int, ttft: float | None, queue: float | None, kv) -> None:
    DESIRED_REPLICAS.labels(namespace, service).set(desired)
    # A signal with no value is NaN: "no data" must not read as "zero latency".
    TTFT_P95.labels(namespace, service).set(float("nan") if ttft is None else ttft)
    QUEUE_DEPTH.labels(namespace, service).set(float("nan") if queue is None else queue)
    KV_USAGE.labels(namespace, service).set(float("nan") if kv is None else kv)


def forget(namespace: str, service: str) -> None:
    """A service that stops autoscaling (or is deleted) leaves no stale series behind."""
    for gauge in _GAUGES:
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, service)
