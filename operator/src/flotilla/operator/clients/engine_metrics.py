"""The default metrics source: each ready engine pod's GET /metrics, scraped once per period.

The parse is pure; the fetch is one HTTP GET per pod. TTFT p95 comes from histogram increases between
scrapes (histogram_window.py), so this source keeps state per service: a `PodScraper`.

Pods are scraped by IP, not through their Service: it is per-pod figures the rule needs (and on the local
cluster Services have no endpoints at all, as pod IPs are loopback addresses).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from flotilla.contract import (
    GENERATION_TOKENS,
    KV_CACHE_USAGE_RATIO,
    LABEL_LORA_NAME,
    LORA_GENERATION_TOKENS,
    LORA_PROMPT_TOKENS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PROMPT_TOKENS,
    TIME_TO_FIRST_TOKEN,
    counter_total,
    engine_metrics_url,
)
from flotilla.operator.autoscaling.histogram_window import Buckets, WindowedHistogram
from flotilla.operator.autoscaling.signals import Signals

TTFT, WAITING, RUNNING, KV_USAGE = (
    TIME_TO_FIRST_TOKEN,
    NUM_REQUESTS_WAITING,
    NUM_REQUESTS_RUNNING,
    KV_CACHE_USAGE_RATIO,
)
PROMPT, GENERATION = counter_total(PROMPT_TOKENS), counter_total(GENERATION_TOKENS)
SUMMED = (WAITING, RUNNING, PROMPT, GENERATION)
LORA_PROMPT, LORA_GENERATION = counter_total(LORA_PROMPT_TOKENS), counter_total(LORA_GENERATION_TOKENS)


@dataclass(frozen=True)
class EngineSample:
    waiting: float
    running: float
    kv_usage: float | None
    ttft_buckets: Buckets  # cumulative, as exported
    prompt_tokens: float | None = None  # lifetime counters; None when the engine exports none
    generation_tokens: float | None = None
    # Per LoRA adapter (label lora_name): lifetime prompt and generation token counters, for the adapters
    # the engine holds now (an unloaded adapter's series go).
    lora_prompt_tokens: dict[str, float] = field(default_factory=dict)
    lora_generation_tokens: dict[str, float] = field(default_factory=dict)


class ScrapeError(Exception):
    pass


def parse_engine_metrics(text: str) -> EngineSample:
    """The one parser of an engine's /metrics (autoscaling signals and token metering both read it).
    Sums over label sets (one engine serves one model, but a sum is right for several too)."""
    gauges: dict[str, float] = {}
    kv: list[float] = []
    buckets: dict[float, float] = {}
    lora: dict[str, dict[str, float]] = {LORA_PROMPT: {}, LORA_GENERATION: {}}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in SUMMED:
                    gauges[sample.name] = gauges.get(sample.name, 0.0) + sample.value
                elif sample.name == KV_USAGE:
                    kv.append(sample.value)
                elif sample.name == f"{TTFT}_bucket":
                    le = float(sample.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + sample.value
                elif sample.name in lora and LABEL_LORA_NAME in sample.labels:
                    per = lora[sample.name]
                    adapter = sample.labels[LABEL_LORA_NAME]
                    per[adapter] = per.get(adapter, 0.0) + sample.value
    except ValueError as exc:
        raise ScrapeError(f"unparseable metrics: {exc}") from exc
    if WAITING not in gauges:
        raise ScrapeError(f"{WAITING} is missing")
    if buckets and not math.isinf(max(buckets)):
        raise ScrapeError(f"{TTFT} has no +Inf bucket")
    return EngineSample(
        waiting=gauges[WAITING],
        running=gauges.get(RUNNING, 0.0),
        kv_usage=max(kv) if kv else None,
        ttft_buckets=tuple(sorted(buckets.items())),
        prompt_tokens=gauges.get(PROMPT),
        generation_tokens=gauges.get(GENERATION),
        lora_prompt_tokens=lora[LORA_PROMPT],
        lora_generation_tokens=lora[LORA_GENERATION],
    )


def metrics_url(pod_ip: str) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return engine_metrics_url(host)


async def scrape(client, pod_ip: str) -> EngineSample:
    """`client` is an httpx.AsyncClient; any failure becomes a ScrapeError naming the pod address."""
    url = metrics_url(pod_ip)
    try:
        response = await client.get(url)
    except Exception as exc:  # connection refused, timeout, ...: the pod did not answer
        raise ScrapeError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise ScrapeError(f"GET {url}: HTTP {response.status_code}")
    return parse_engine_metrics(response.text)


async def scrape_all(client, pod_ips: dict[str, str]) -> dict[str, EngineSample | ScrapeError]:
    """pod name -> IP, scraped concurrently."""
    names = list(pod_ips)
    results = await asyncio.gather(*(scrape(client, pod_ips[n]) for n in names), return_exceptions=True)
    out: dict[str, EngineSample | ScrapeError] = {}
    for name, result in zip(names, results, strict=True):
        if isinstance(result, BaseException) and not isinstance(result, ScrapeError):
            result = ScrapeError(f"{type(result).__name__}: {result}")
        out[name] = result
    return out


class PodScraper:
    """One service's scrape state: the TTFT window and each pod's last histogram."""

    def __init__(self, window_seconds: float) -> None:
        self.window = WindowedHistogram(window_seconds)

    def signals(self, now: float, scraped: dict[str, EngineSample | ScrapeError], live: set[str]) -> Signals:
        """Pure: one round of scrapes (pod name -> sample or error) into the period's signals."""
        ok = {n: s for n, s in scraped.items() if isinstance(s, EngineSample)}
        self.window.observe(now, {n: s.ttft_buckets for n, s in ok.items() if s.ttft_buckets})
        self.window.forget(live)
        kv = [s.kv_usage for s in ok.values() if s.kv_usage is not None]
        return Signals(
            waiting={n: s.waiting for n, s in ok.items()},
            ttft_p95=self.window.quantile(0.95),
            kv_usage=max(kv) if kv else None,
            errors={n: str(s) for n, s in scraped.items() if isinstance(s, ScrapeError)},
            running={n: s.running for n, s in ok.items()},
            tokens={
                n: (s.prompt_tokens or 0.0) + (s.generation_tokens or 0.0)
                for n, s in ok.items()
                if s.prompt_tokens is not None or s.generation_tokens is not None
            },
        )

    async def collect(
        self, client, now: float, window_seconds: float, pod_ips: dict[str, str], live: set[str]
    ):
        self.window.window = window_seconds
        return self.signals(now, await scrape_all(client, pod_ips), live)
