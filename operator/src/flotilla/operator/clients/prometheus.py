"""The alternative metrics source: a Prometheus server that already scrapes the engine pods.

`flotilla operator run --prometheus-url URL` switches to it. The engine series must carry the target
labels `namespace` and `pod` (what the usual kubernetes-pods scrape job's relabeling gives) next to the
engine's own `service` label. Prometheus does the windowing: rate() over the TTFT window is reset-aware,
and histogram_quantile() interpolates exactly as histogram_window.py does for the scrape source.
The query text and the parse of answers are pure; `collect` is three HTTP GETs.
"""

from __future__ import annotations

import asyncio
import math

from flotilla.contract import (
    GENERATION_TOKENS,
    KV_CACHE_USAGE_RATIO,
    LABEL_SERVICE,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PROMPT_TOKENS,
    TIME_TO_FIRST_TOKEN,
    counter_total,
)
from flotilla.operator.autoscaling.signals import Signals

WAITING, TTFT_P95, KV, RUNNING, TOKENS = "waiting", "ttft_p95", "kv", "running", "tokens"


def queries(namespace: str, service: str, window_seconds: int) -> dict[str, str]:
    sel = f'namespace="{namespace}",{LABEL_SERVICE}="{service}"'
    return {
        WAITING: f"sum by (pod) ({NUM_REQUESTS_WAITING}{{{sel}}})",
        TTFT_P95: (
            "histogram_quantile(0.95, sum by (le) "
            f"(rate({TIME_TO_FIRST_TOKEN}_bucket{{{sel}}}[{window_seconds}s])))"
        ),
        KV: f"max({KV_CACHE_USAGE_RATIO}{{{sel}}})",
        RUNNING: f"sum by (pod) ({NUM_REQUESTS_RUNNING}{{{sel}}})",
        # Lifetime prompt + generation tokens per pod, for the idle rule: unchanged means nothing served.
        TOKENS: (
            f'sum by (pod) ({{__name__=~"{counter_total(PROMPT_TOKENS)}|{counter_total(GENERATION_TOKENS)}",'
            f"{sel}}})"
        ),
    }


class PrometheusError(Exception):
    pass


def vector(payload: dict) -> list[tuple[dict, float]]:
    """An instant-vector answer of /api/v1/query as (labels, value) pairs."""
    if payload.get("status") != "success":
        raise PrometheusError(f"{payload.get('errorType', 'error')}: {payload.get('error', payload)}")
    data = payload.get("data") or {}
    if data.get("resultType") != "vector":
        raise PrometheusError(f"expected a vector, got {data.get('resultType')!r}")
    return [(r.get("metric") or {}, float(r["value"][1])) for r in data.get("result") or []]


def _single(pairs: list[tuple[dict, float]]) -> float | None:
    """One aggregated value; NaN (histogram_quantile of no requests) and no series are both None."""
    if not pairs or math.isnan(pairs[0][1]):
        return None
    return pairs[0][1]


def signals_from(answers: dict[str, list[tuple[dict, float]]], ready_pods: set[str]) -> Signals:
    waiting = {labels["pod"]: value for labels, value in answers[WAITING] if labels.get("pod") in ready_pods}
    missing = {pod: f"no {NUM_REQUESTS_WAITING} series in Prometheus" for pod in ready_pods - set(waiting)}

    def per_pod(key: str) -> dict[str, float]:
        return {labels["pod"]: v for labels, v in answers.get(key, []) if labels.get("pod") in ready_pods}

    return Signals(
        waiting=waiting,
        ttft_p95=_single(answers[TTFT_P95]),
        kv_usage=_single(answers[KV]),
        errors=missing,
        running=per_pod(RUNNING),
        tokens=per_pod(TOKENS),
    )


class Unavailable(Exception):
    """Prometheus did not answer (unreachable, bad JSON, a query error); the message says which."""


async def query(
    client, base_url: str, namespace: str, service: str, window_seconds: int, ready_pods: set[str]
) -> Signals:
    """`client` is an httpx.AsyncClient. Raises Unavailable when Prometheus cannot answer: the
    autoscaler then scrapes the engines itself (controllers/autoscaling.py) and says so."""
    url = base_url.rstrip("/") + "/api/v1/query"
    named = queries(namespace, service, window_seconds)
    try:
        responses = await asyncio.gather(*(client.get(url, params={"query": q}) for q in named.values()))
        answers = {key: vector(r.json()) for key, r in zip(named, responses, strict=True)}
    except Exception as exc:  # unreachable, bad JSON, a query error
        raise Unavailable(f"Prometheus at {base_url}: {type(exc).__name__}: {exc}") from exc
    return signals_from(answers, ready_pods)


async def collect(
    client, base_url: str, namespace: str, service: str, window_seconds: int, ready_pods: set[str]
) -> Signals:
    """As `query`, but when Prometheus cannot answer every pod counts as silent, so the rule holds the
    replicas (it never scales down on an outage)."""
    try:
        return await query(client, base_url, namespace, service, window_seconds, ready_pods)
    except Unavailable as exc:
        return Signals(waiting={}, ttft_p95=None, errors=dict.fromkeys(ready_pods, str(exc)))
