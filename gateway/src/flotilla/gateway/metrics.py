"""The gateway's own series (names from flotilla.contract), in a registry of its own: requests by tenant,
model and code; routing decisions by reason; the predicted prefix-hit share (hit tokens over prompt tokens);
upstream time to first output (the series keeps its first-byte name); requests held at zero replicas and cold-start time; the gateway's added
latency; rate-limit refusals and retries; streams cut after their first output."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flotilla.contract import (
    GATEWAY_ADDED_LATENCY,
    GATEWAY_COLD_START,
    GATEWAY_HELD_REQUESTS,
    GATEWAY_PREDICTED_HIT_TOKENS,
    GATEWAY_PROMPT_TOKENS,
    GATEWAY_RATE_LIMIT_STORE_ERRORS,
    GATEWAY_RATE_LIMITED,
    GATEWAY_REQUESTS,
    GATEWAY_RETRIES,
    GATEWAY_ROUTING_DECISIONS,
    GATEWAY_STREAM_ERRORS,
    GATEWAY_UPSTREAM_TTFB,
    LABEL_CODE,
    LABEL_LIMIT,
    LABEL_MODEL,
    LABEL_REASON,
    LABEL_TENANT,
    LATENCY_BUCKETS,
)

# The gateway adds well under a millisecond on a quiet machine: finer buckets than the engine's at the bottom.
ADDED_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
COLD_START_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(GATEWAY_REQUESTS, "requests answered, by tenant, model and HTTP status",
                                [LABEL_TENANT, LABEL_MODEL, LABEL_CODE], registry=r)  # fmt: skip
        self.decisions = Counter(GATEWAY_ROUTING_DECISIONS, "routing decisions by reason", [LABEL_REASON],
                                 registry=r)  # fmt: skip
        self.prompt_tokens = Counter(GATEWAY_PROMPT_TOKENS, "prompt tokens routed", registry=r)
        self.predicted_hit_tokens = Counter(
            GATEWAY_PREDICTED_HIT_TOKENS, "prompt tokens the chosen replica was predicted to hold", registry=r
        )
        self.upstream_ttfb = Histogram(GATEWAY_UPSTREAM_TTFB, "request sent to the replica's first output (a token event, or the whole body): the commit point",
                                       [LABEL_MODEL], buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.added_latency = Histogram(GATEWAY_ADDED_LATENCY, "arrival to upstream send, not counting holds",
                                       buckets=ADDED_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.held = Gauge(GATEWAY_HELD_REQUESTS, "requests waiting for a replica", [LABEL_MODEL], registry=r)
        self.cold_start = Histogram(GATEWAY_COLD_START, "held at zero replicas until sent to a ready one",
                                    [LABEL_MODEL], buckets=COLD_START_BUCKETS, registry=r)  # fmt: skip
        self.rate_limited = Counter(GATEWAY_RATE_LIMITED, "requests refused by a tenant rate limit",
                                    [LABEL_TENANT, LABEL_LIMIT], registry=r)  # fmt: skip
        self.rate_limit_store_errors = Counter(
            GATEWAY_RATE_LIMIT_STORE_ERRORS,
            "rate-limit decisions the shared store failed (decided by this replica's own buckets instead)",
            registry=r,
        )
        self.retries = Counter(
            GATEWAY_RETRIES, "requests retried on another replica", [LABEL_MODEL], registry=r
        )
        self.stream_errors = Counter(
            GATEWAY_STREAM_ERRORS,
            "streams whose replica was lost after their first output, ended with an error event, by reason",
            [LABEL_REASON],
            registry=r,
        )

    def known(self, models: list[str], limited: Mapping[str, Sequence[str]]) -> None:
        """Starts at 0 the labelled series of what the gateway serves (its models; its tenants' configured
        limits), so that a dashboard reads "none yet" as 0 rather than as no data: a counter that first
        appears at 1 shows no increase. Series of models that went away are kept (a counter does not
        go backwards)."""
        for model in models:
            self.retries.labels(model)
            self.held.labels(model)
        for tenant, kinds in limited.items():
            for kind in kinds:
                self.rate_limited.labels(tenant, kind)
