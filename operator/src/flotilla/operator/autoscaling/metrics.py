"""The autoscaler's Prometheus series, served on the operator's /metrics (metrics.py's registry)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge

from flotilla.contract import (
    AUTOSCALER_DESIRED_REPLICAS,
    AUTOSCALER_KV_CACHE_USAGE,
    AUTOSCALER_QUEUE_DEPTH,
    AUTOSCALER_SCALES,
    AUTOSCALER_SCRAPE_FAILURES,
    AUTOSCALER_TTFT_P95,
    LABEL_DIRECTION,
    LABEL_NAMESPACE,
    LABEL_SERVICE,
)

LABELS = (LABEL_NAMESPACE, LABEL_SERVICE)

DESIRED_REPLICAS = Gauge(
    AUTOSCALER_DESIRED_REPLICAS, "Replicas the autoscaler decided on at its last decision", LABELS
)
TTFT_P95 = Gauge(AUTOSCALER_TTFT_P95, "Time to first token p95 over the service's TTFT window", LABELS)
QUEUE_DEPTH = Gauge(AUTOSCALER_QUEUE_DEPTH, "Waiting requests per ready replica", LABELS)
KV_USAGE = Gauge(AUTOSCALER_KV_CACHE_USAGE, "Highest KV cache usage of the ready pods", LABELS)
SCRAPE_FAILURES = Counter(
    AUTOSCALER_SCRAPE_FAILURES,
    "Reads of a pod's signals that failed (its /metrics, or Prometheus for it)",
    LABELS,
)
SCALES = Counter(AUTOSCALER_SCALES, "Scale changes the autoscaler made", [*LABELS, LABEL_DIRECTION])

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
