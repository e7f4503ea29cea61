"""The per-service recording rules, keyed by `namespace` and `service`: latency percentiles, TTFT
SLO attainment, traffic, queue, caches and replicas; and per LoRA adapter on a service (`lora_name` too),
its requests and tokens."""

from __future__ import annotations

from flotilla import contract as c
from flotilla.monitoring.rules.model import GENERATION, PROMPT, Record, quantile, rate
from flotilla.monitoring.rules.names import (
    ADAPTER_BY,
    ADAPTER_INPUT_TOKENS,
    ADAPTER_OUTPUT_TOKENS,
    ADAPTER_REQUESTS,
    RATE_WINDOW,
    SERVICE_BY,
    SERVICE_E2E_P50,
    SERVICE_E2E_P95,
    SERVICE_E2E_P99,
    SERVICE_INPUT_TOKENS,
    SERVICE_ITL_P50,
    SERVICE_ITL_P95,
    SERVICE_ITL_P99,
    SERVICE_KV_CACHE_USAGE,
    SERVICE_OUTPUT_TOKENS,
    SERVICE_PREFIX_CACHE_HIT,
    SERVICE_QUEUE_DEPTH,
    SERVICE_READY,
    SERVICE_REPLICAS_DESIRED,
    SERVICE_REPLICAS_READY,
    SERVICE_REPLICAS_READY_RATIO,
    SERVICE_REQUESTS,
    SERVICE_RUNNING,
    SERVICE_TTFT_P50,
    SERVICE_TTFT_P95,
    SERVICE_TTFT_P99,
    SERVICE_TTFT_SLO,
    SERVICE_TTFT_TARGET,
)


def _latency_records() -> list[Record]:
    names = {
        (c.TIME_TO_FIRST_TOKEN, "time to first token"): (
            SERVICE_TTFT_P50,
            SERVICE_TTFT_P95,
            SERVICE_TTFT_P99,
        ),
        (c.INTER_TOKEN_LATENCY, "inter-token latency"): (SERVICE_ITL_P50, SERVICE_ITL_P95, SERVICE_ITL_P99),
        (c.E2E_REQUEST_LATENCY, "end-to-end latency"): (SERVICE_E2E_P50, SERVICE_E2E_P95, SERVICE_E2E_P99),
    }
    return [
        Record(
            name,
            quantile(q, histogram),
            f"{what} p{round(q * 100)} over {RATE_WINDOW}; none without requests",
        )
        for (histogram, what), recorded in names.items()
        for q, name in zip((0.5, 0.95, 0.99), recorded, strict=True)
    ]


SERVICE_RULES = (
    *_latency_records(),
    Record(
        SERVICE_TTFT_TARGET,
        f"max by ({SERVICE_BY}) ({c.SERVICE_TTFT_TARGET})",
        "spec.autoscaling.ttftP95TargetSeconds, for services that set it",
    ),
    # PromQL cannot compare a label with a value, so the `le` of "the bucket at the target" comes from the
    # operator: its target series carries the largest engine bucket boundary at or below the target as
    # `le` (flotilla.operator.metrics.slo_bucket), and `and on (..., le)` keeps that bucket of each
    # service's histogram. The share is of requests within that boundary, so a target between two
    # boundaries (0.6 s with buckets 0.5 and 0.75) is measured at the lower one: attainment is
    # under-, never over-stated. A target below the smallest bucket (1 ms) has no `le` and no series.
    Record(
        SERVICE_TTFT_SLO,
        f"sum by ({SERVICE_BY}) (\n"
        f"  {rate(c.TIME_TO_FIRST_TOKEN + '_bucket')}\n"
        f"  and on ({SERVICE_BY}, {c.LABEL_LE}) {c.SERVICE_TTFT_TARGET}\n"
        ")\n"
        f"/ (sum by ({SERVICE_BY}) ({rate(c.TIME_TO_FIRST_TOKEN + '_count')}) > 0)",
        "share of requests whose TTFT met the service's own target (at the bucket boundary at or below it)",
    ),
    Record(
        SERVICE_REQUESTS,
        f"sum by ({SERVICE_BY}) ({rate(c.counter_total(c.REQUEST_SUCCESS))})",
        "finished requests per second, all finish reasons",
    ),
    Record(
        SERVICE_QUEUE_DEPTH,
        f"sum by ({SERVICE_BY}) ({c.NUM_REQUESTS_WAITING})",
        "requests waiting, all pods",
    ),
    Record(
        SERVICE_RUNNING, f"sum by ({SERVICE_BY}) ({c.NUM_REQUESTS_RUNNING})", "requests running, all pods"
    ),
    Record(
        SERVICE_KV_CACHE_USAGE,
        f"max by ({SERVICE_BY}) ({c.KV_CACHE_USAGE_RATIO})",
        "KV-cache usage of the fullest pod",
    ),
    Record(
        SERVICE_PREFIX_CACHE_HIT,
        f"sum by ({SERVICE_BY}) ({rate(c.counter_total(c.PREFIX_CACHE_HITS))})\n"
        f"/ (sum by ({SERVICE_BY}) ({rate(c.counter_total(c.PREFIX_CACHE_QUERIES))}) > 0)",
        "prompt tokens found in the prefix cache / prompt tokens looked up",
    ),
    Record(SERVICE_INPUT_TOKENS, f"sum by ({SERVICE_BY}) ({rate(PROMPT)})", "prompt tokens per second"),
    Record(
        SERVICE_OUTPUT_TOKENS, f"sum by ({SERVICE_BY}) ({rate(GENERATION)})", "generated tokens per second"
    ),
    Record(SERVICE_READY, f"max by ({SERVICE_BY}) ({c.SERVICE_READY})", "1 when the Ready condition is True"),
    Record(
        SERVICE_REPLICAS_DESIRED,
        f"max by ({SERVICE_BY}) ({c.SERVICE_DESIRED_REPLICAS})",
        "replicas the operator asks for",
    ),
    Record(
        SERVICE_REPLICAS_READY, f"max by ({SERVICE_BY}) ({c.SERVICE_READY_REPLICAS})", "ready engine pods"
    ),
    Record(
        SERVICE_REPLICAS_READY_RATIO,
        f"{SERVICE_REPLICAS_READY} / ({SERVICE_REPLICAS_DESIRED} > 0)",
        "ready / desired replicas; none for a service scaled to zero",
    ),
    Record(
        ADAPTER_INPUT_TOKENS,
        f"sum by ({ADAPTER_BY}) ({rate(c.counter_total(c.LORA_PROMPT_TOKENS))})",
        "prompt tokens per second of requests finished with the LoRA adapter",
    ),
    Record(
        ADAPTER_OUTPUT_TOKENS,
        f"sum by ({ADAPTER_BY}) ({rate(c.counter_total(c.LORA_GENERATION_TOKENS))})",
        "tokens generated per second with the LoRA adapter",
    ),
    Record(
        ADAPTER_REQUESTS,
        f"sum by ({ADAPTER_BY}) ({rate(c.counter_total(c.LORA_REQUESTS))})",
        "requests finished per second with the LoRA adapter",
    ),
)
