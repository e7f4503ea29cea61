"""The engine's Prometheus metrics (names and meanings from DESIGN.md "Contracts").

Latency histograms are observed by the server as outputs stream out. Counters and gauges are read
from the engine's stats snapshot at scrape time, so the engine loop never waits on the metrics.
Every series carries `model`, `tenant` and `service`; the operator sets the tenant and service
environment variables (flotilla.contract), and an unset one is exported as "" (which Prometheus treats
as no label). Names, labels and variables all come from flotilla.contract.

Two kinds of series carry `tenant`, with two meanings:

- the engine-wide ones (TIME_TO_FIRST_TOKEN, PROMPT_TOKENS, NUM_REQUESTS_WAITING, ...): `tenant` is the
  pod's tenant, ENV_TENANT, the Tenant owning the namespace; one value per engine.
- the per-tenant ones (TENANT_PROMPT_TOKENS, TENANT_GENERATION_TOKENS, TENANT_VIRTUAL_TOKEN_COUNTER,
  TENANT_NUM_REQUESTS_WAITING, TENANT_TIME_TO_FIRST_TOKEN): `tenant` is the request's tenant, the one the
  gateway named in HEADER_TENANT (server/tenancy.py), else the pod's. One series per request tenant.

Request tenants come from traffic, so their number is capped (ServerSettings.max_tenant_labels, default
DEFAULT_MAX_TENANT_LABELS): the first tenants seen keep their own label for the life of the process, and
every later one is reported under OTHER_TENANT, so a family has at most cap + 1 `tenant` values. Under
OTHER_TENANT the token counters and the waiting requests are the sums over those tenants (the set only
grows, so the sums only grow, as counters must); the virtual token counter is their maximum, which bounds
how far ahead any of them is (a sum of counters is no tenant's standing). A tenant really named like
OTHER_TENANT is reported there too and takes no label of its own.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator

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
    LABEL_DTYPE,
    LABEL_FINISH_REASON,
    LABEL_LORA_NAME,
    LABEL_MAX_LORA,
    LABEL_MODEL,
    LABEL_POSITION,
    LABEL_QUANTIZATION,
    LABEL_QUANTIZATION_GROUP_SIZE,
    LABEL_RUNNING_LORA_ADAPTERS,
    LABEL_SERVICE,
    LABEL_TENANT,
    LABEL_WAITING_LORA_ADAPTERS,
    LATENCY_BUCKETS,
    LORA_GENERATION_TOKENS,
    LORA_PROMPT_TOKENS,
    LORA_REQUESTS,
    LORA_REQUESTS_INFO,
    MODEL_INFO,
    MODEL_WEIGHT_BYTES,
    NUM_PREEMPTIONS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    OTHER_TENANT,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
    SPEC_DECODE_ACCEPTED_PER_POSITION,
    SPEC_DECODE_ACCEPTED_TOKENS,
    SPEC_DECODE_DRAFT_TOKENS,
    SPEC_DECODE_DRAFTS,
    TENANT_GENERATION_TOKENS,
    TENANT_NUM_REQUESTS_WAITING,
    TENANT_PROMPT_TOKENS,
    TENANT_TIME_TO_FIRST_TOKEN,
    TENANT_VIRTUAL_TOKEN_COUNTER,
    TIME_TO_FIRST_TOKEN,
)
from flotilla.engine.core.outputs import EngineStats, ModelInfo, RequestOutput, SpecDecodeStats, TenantStats

LABELS = ENGINE_LABELS
DEFAULT_MAX_TENANT_LABELS = 32  # distinct request tenants the per-tenant series name; the rest: OTHER_TENANT


def label_values(model: str) -> dict[str, str]:
    return {
        LABEL_MODEL: model,
        LABEL_TENANT: os.environ.get(ENV_TENANT, ""),
        LABEL_SERVICE: os.environ.get(ENV_SERVICE, ""),
    }


class TenantLabels:
    """A request tenant's `tenant` label value: its own name for the first `cap` tenants asked about,
    OTHER_TENANT for every later one. Stable: a tenant's label never changes."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"the tenant label cap must be 1 or more, got {cap}")
        self.cap = cap
        self._named: set[str] = set()
        self._lock = threading.Lock()  # scrapes and requests may ask from different threads

    def __call__(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        with self._lock:
            if tenant in self._named:
                return tenant
            if tenant != OTHER_TENANT and len(self._named) < self.cap:
                self._named.add(tenant)
                return tenant
        return OTHER_TENANT


class _StatsCollector:
    """Turns an EngineStats snapshot into gauges and counters at scrape time."""

    def __init__(
        self, stats: Callable[[], EngineStats | None], labels: dict[str, str], tenant_label: TenantLabels
    ) -> None:
        self._stats = stats
        self._labels = labels
        self._tenant_label = tenant_label

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
        yield from self._per_tenant(stats.tenants)
        yield from self._spec_decode(stats.spec_decode, counter)
        if stats.max_loras:
            yield from self._lora(stats)

    def _lora(self, stats: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """vLLM's LoRA info gauge, and per loaded adapter its requests and tokens (only with --enable-lora;
        at most --max-cpu-loras adapters, so the label is bounded)."""
        names, values = list(self._labels), list(self._labels.values())
        info = GaugeMetricFamily(
            LORA_REQUESTS_INFO,
            "LoRA slots, and the adapters of running and of waiting requests (comma-separated labels).",
            labels=[*names, LABEL_MAX_LORA, LABEL_RUNNING_LORA_ADAPTERS, LABEL_WAITING_LORA_ADAPTERS],
        )
        info.add_metric(
            [*values, str(stats.max_loras), ",".join(stats.running_loras), ",".join(stats.waiting_loras)], 1
        )
        yield info
        for name, doc, read in (
            (LORA_REQUESTS, "Finished requests, by LoRA adapter.", lambda s: s.requests),
            (
                LORA_PROMPT_TOKENS,
                "Prompt tokens of finished requests, by LoRA adapter.",
                lambda s: s.prompt_tokens,
            ),
            (LORA_GENERATION_TOKENS, "Tokens generated, by LoRA adapter.", lambda s: s.generation_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=[*names, LABEL_LORA_NAME])
            for adapter, served in sorted(stats.loras.items()):
                family.add_metric([*values, adapter], read(served))
            yield family

    def _spec_decode(self, spec: SpecDecodeStats, counter) -> Iterator[CounterMetricFamily]:
        """vLLM's speculative-decoding counters; all zero when the engine does not speculate."""
        yield counter(SPEC_DECODE_DRAFTS, "Steps in which a request verified drafts.", spec.num_drafts)
        yield counter(SPEC_DECODE_DRAFT_TOKENS, "Draft tokens verified.", spec.num_draft_tokens)
        yield counter(SPEC_DECODE_ACCEPTED_TOKENS, "Draft tokens accepted.", spec.num_accepted_tokens)
        names, values = list(self._labels), list(self._labels.values())
        per_position = CounterMetricFamily(
            SPEC_DECODE_ACCEPTED_PER_POSITION,
            "Draft tokens accepted, by position in the draft (0 is the first).",
            labels=[*names, LABEL_POSITION],
        )
        for position, count in enumerate(spec.accepted_per_position):
            per_position.add_metric([*values, str(position)], count)
        yield per_position

    def _per_tenant(
        self, tenants: dict[str, TenantStats]
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The per-tenant families, `tenant` being the request's tenant (capped; see the module doc)."""
        grouped: dict[str, list[TenantStats]] = defaultdict(list)
        for tenant, service in tenants.items():  # in arrival order, so the first tenants get the labels
            grouped[self._tenant_label(tenant)].append(service)
        names = list(self._labels)
        prompt = CounterMetricFamily(
            TENANT_PROMPT_TOKENS, "Prompt tokens processed, by request tenant.", labels=names
        )
        generation = CounterMetricFamily(
            TENANT_GENERATION_TOKENS, "Tokens generated, by request tenant.", labels=names
        )
        counter = GaugeMetricFamily(
            TENANT_VIRTUAL_TOKEN_COUNTER,
            "The fair scheduler's virtual token counter (weighted tokens served / weight), by request "
            f"tenant; the maximum of the tenants under '{OTHER_TENANT}'.",
            labels=names,
        )
        waiting = GaugeMetricFamily(
            TENANT_NUM_REQUESTS_WAITING,
            "Requests queued, not yet scheduled, by request tenant.",
            labels=names,
        )
        for label, group in grouped.items():
            values = list((self._labels | {LABEL_TENANT: label}).values())
            prompt.add_metric(values, sum(s.prompt_tokens for s in group))
            generation.add_metric(values, sum(s.generation_tokens for s in group))
            counter.add_metric(values, max(s.counter for s in group))
            waiting.add_metric(values, sum(s.num_waiting for s in group))
        yield from (prompt, generation, counter, waiting)


class _ModelInfoCollector:
    """The loaded model's weight bytes and an info gauge (1) labelled with its quantization, int4 group
    size ("" otherwise) and float dtype. Families without samples until the model has loaded."""

    def __init__(self, info: Callable[[], ModelInfo | None], labels: dict[str, str]) -> None:
        self._info = info
        self._labels = labels

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = self._info()
        names, values = list(self._labels), list(self._labels.values())
        weights = GaugeMetricFamily(
            MODEL_WEIGHT_BYTES,
            "Bytes of the loaded model's weights (quantized weights and their scales included).",
            labels=names,
        )
        described = GaugeMetricFamily(
            MODEL_INFO,
            "The loaded model: its weight-only quantization (none, int8, int4), int4 group size and float dtype.",
            labels=[*names, LABEL_QUANTIZATION, LABEL_QUANTIZATION_GROUP_SIZE, LABEL_DTYPE],
        )
        if info is not None:
            weights.add_metric(values, info.weight_bytes)
            group = "" if info.quantization_group_size is None else str(info.quantization_group_size)
            described.add_metric([*values, info.quantization, group, info.dtype], 1)
        yield weights
        yield described


class EngineMetrics:
    def __init__(
        self,
        model: str,
        stats: Callable[[], EngineStats | None],
        max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS,
        model_info: Callable[[], ModelInfo | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.labels = label_values(model)
        self.tenant_label = TenantLabels(max_tenant_labels)
        names = list(self.labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, names, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.ttft = histogram(TIME_TO_FIRST_TOKEN, "Arrival to first generated token, in seconds.").labels(
            **self.labels
        )
        self.itl = histogram(
            INTER_TOKEN_LATENCY, "Gap between consecutive tokens of a request, in seconds."
        ).labels(**self.labels)
        self.e2e = histogram(E2E_REQUEST_LATENCY, "Arrival to last token, in seconds.").labels(**self.labels)
        self._tenant_ttft = histogram(
            TENANT_TIME_TO_FIRST_TOKEN, "Arrival to first generated token, in seconds, by request tenant."
        )
        self.registry.register(_StatsCollector(stats, self.labels, self.tenant_label))
        self.registry.register(_ModelInfoCollector(model_info, self.labels))

    def tenant_ttft(self, tenant: str) -> Histogram:
        """The TTFT histogram of a request tenant (its capped label)."""
        return self._tenant_ttft.labels(**(self.labels | {LABEL_TENANT: self.tenant_label(tenant)}))


class RequestTimer:
    """Observes one engine request's latencies from the timestamps on its outputs. Made when the request
    starts, so its tenant's label is settled in arrival order."""

    def __init__(self, metrics: EngineMetrics, tenant: str = "") -> None:
        self.metrics = metrics
        self._tenant_ttft = metrics.tenant_ttft(tenant)
        self._last_token_time: float | None = None

    def observe(self, out: RequestOutput) -> None:
        if out.new_token_ids and out.last_token_time is not None:
            if self._last_token_time is None:
                if out.first_token_time is not None:
                    ttft = max(0.0, out.first_token_time - out.arrival_time)
                    self.metrics.ttft.observe(ttft)
                    self._tenant_ttft.observe(ttft)
            else:
                self.metrics.itl.observe(max(0.0, out.last_token_time - self._last_token_time))
            self._last_token_time = out.last_token_time
        if out.finished and out.finish_reason != "abort" and out.last_token_time is not None:
            self.metrics.e2e.observe(max(0.0, out.last_token_time - out.arrival_time))
