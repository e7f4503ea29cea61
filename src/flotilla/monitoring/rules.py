"""Flotilla's Prometheus recording rules and alerts, as data: the one source of the rules file
(deploy/monitoring/flotilla-rules.yaml, `flotilla monitoring rules`), of a PrometheusRule
(`prometheus_rule`) and of the dashboards, which import the recorded names below.

Every series name comes from flotilla.contract (the engine's and the operator's); recorded series are
named `flotilla:<level>_<what>[:<operation>]`. Per-service series are keyed by `namespace` and `service`,
per-tenant ones by `tenant` (and `gpu_type`): no rule keeps a per-request or per-user label.

What the rules assume of the scrape:
- engine series carry the pod's `namespace` (a target label, as kubernetes_sd's usual relabeling gives)
  next to the engine's own `tenant` and `service`;
- the operator's series keep their own `namespace` label: scrape the operator with `honor_labels: true`
  (a ServiceMonitor's `honorLabels`), or Prometheus renames it `exported_namespace` when the operator's pod
  is scraped with a `namespace` target label of its own.
- no job names: an engine target is a target that exported engine series in the last hours, the operator
  is whatever exports its reconcile counters.

Divisions are guarded the way vLLM's dashboards do it (`x / (y > 0)`): no traffic gives no series, never
NaN, and a quantile of no requests is no series either.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import yaml

from flotilla import contract as c

RATE_WINDOW = "5m"  # operational rates and latency quantiles
COST_WINDOW = "1h"  # cost per token and idle GPUs: an accounting window, long enough to be fair
ENGINE_SEEN_WINDOW = "6h"  # a down target counts as an engine when it exported engine series this recently

QUOTA_ALERT_RATIO = 0.9
DENIAL_SPIKE = 10  # refusals of one reason for one tenant in DENIAL_WINDOW
DENIAL_WINDOW = "10m"
METERING_STALE_SECONDS = 600  # metering runs every 10 s by default (--metering-interval)

SERVICE_BY = f"{c.LABEL_NAMESPACE}, {c.LABEL_SERVICE}"
TENANT_BY = c.LABEL_TENANT
TENANT_TYPE_BY = f"{c.LABEL_TENANT}, {c.LABEL_GPU_TYPE}"


@dataclass(frozen=True)
class Record:
    name: str
    expr: str
    doc: str  # a comment above the rule in the rendered file


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str  # "" fires at once
    severity: str  # "warning" | "critical"
    summary: str
    description: str
    runbook: str  # one line: what to look at and what to do
    # What the alert watches, with a series whenever its inputs exist, firing or not: the expression with
    # `bool` on each comparison (0 or 1 per matched pair), or what absent() reads. A healthy fleet fires no
    # alert, but it must give every signal a series (e2e/test_governance.py evaluates them live), so that a
    # quiet alert is told apart from one whose expression can never match. Not in the rules file.
    signal: str


@dataclass(frozen=True)
class Group:
    name: str
    rules: tuple[Record | Alert, ...]


def _rate(name: str, window: str = RATE_WINDOW, selector: str = "") -> str:
    return f"rate({name}{selector}[{window}])"


def _quantile(q: float, histogram: str, by: str = SERVICE_BY) -> str:
    """histogram_quantile over the rate window, only where requests were observed (no NaN)."""
    return (
        f"histogram_quantile({q},\n"
        f"  sum by ({by}, {c.LABEL_LE}) ({_rate(histogram + '_bucket')})\n"
        f"  and on ({by}) (sum by ({by}) ({_rate(histogram + '_count')}) > 0)\n"
        ")"
    )


# -- recorded names (dashboards import these) ----------------------------------------------------------------
# Per service {namespace, service}.
SERVICE_TTFT_P50 = "flotilla:service_ttft_seconds:p50_5m"
SERVICE_TTFT_P95 = "flotilla:service_ttft_seconds:p95_5m"
SERVICE_TTFT_P99 = "flotilla:service_ttft_seconds:p99_5m"
SERVICE_ITL_P50 = "flotilla:service_itl_seconds:p50_5m"
SERVICE_ITL_P95 = "flotilla:service_itl_seconds:p95_5m"
SERVICE_ITL_P99 = "flotilla:service_itl_seconds:p99_5m"
SERVICE_E2E_P50 = "flotilla:service_e2e_seconds:p50_5m"
SERVICE_E2E_P95 = "flotilla:service_e2e_seconds:p95_5m"
SERVICE_E2E_P99 = "flotilla:service_e2e_seconds:p99_5m"
SERVICE_TTFT_TARGET = "flotilla:service_ttft_target_seconds"
SERVICE_TTFT_SLO = "flotilla:service_ttft_slo_attainment:ratio_5m"
SERVICE_REQUESTS = "flotilla:service_requests:rate5m"
SERVICE_QUEUE_DEPTH = "flotilla:service_queue_depth"
SERVICE_RUNNING = "flotilla:service_requests_running"
SERVICE_KV_CACHE_USAGE = "flotilla:service_kv_cache_usage:max"
SERVICE_PREFIX_CACHE_HIT = "flotilla:service_prefix_cache_hit:ratio_5m"
SERVICE_INPUT_TOKENS = "flotilla:service_input_tokens:rate5m"
SERVICE_OUTPUT_TOKENS = "flotilla:service_output_tokens:rate5m"
SERVICE_READY = "flotilla:service_ready"
SERVICE_REPLICAS_DESIRED = "flotilla:service_replicas_desired"
SERVICE_REPLICAS_READY = "flotilla:service_replicas_ready"
SERVICE_REPLICAS_READY_RATIO = "flotilla:service_replicas_ready:ratio"
# Per tenant {tenant} or {tenant, gpu_type}; the per-service cost series also carry `tenant`.
TENANT_GPUS_ALLOCATED = "flotilla:tenant_gpus_allocated"
TENANT_GPU_QUOTA = "flotilla:tenant_gpu_quota"
TENANT_GPU_QUOTA_USAGE = "flotilla:tenant_gpu_quota_usage:ratio"
TENANT_GPU_HOURS = "flotilla:tenant_gpu_hours"
TENANT_PRICE = "flotilla:tenant_price_per_gpu_hour"
TENANT_COST_PER_HOUR = "flotilla:tenant_cost_per_hour"
TENANT_COST = "flotilla:tenant_cost"
TENANT_MONTH_COST = "flotilla:tenant_month_cost"
TENANT_MONTH_COST_FORECAST = "flotilla:tenant_month_cost:forecast"
TENANT_MONTHLY_BUDGET = "flotilla:tenant_monthly_budget"
TENANT_INPUT_TOKENS = "flotilla:tenant_input_tokens:rate5m"
TENANT_OUTPUT_TOKENS = "flotilla:tenant_output_tokens:rate5m"
SERVICE_GPUS = "flotilla:service_gpus:avg1h"
SERVICE_TOKENS = "flotilla:service_tokens:rate1h"
TENANT_TOKENS = "flotilla:tenant_tokens:rate1h"
SERVICE_COST_PER_HOUR = "flotilla:service_cost_per_hour:avg1h"
SERVICE_COST_PER_MILLION_TOKENS = "flotilla:service_cost_per_million_tokens:1h"
TENANT_COST_PER_MILLION_TOKENS = "flotilla:tenant_cost_per_million_tokens:1h"
TENANT_IDLE_GPU_RATIO = "flotilla:tenant_idle_gpus:ratio_1h"
TENANT_METERING_LAG = "flotilla:tenant_metering_lag_seconds"
# The operator.
ADMISSION_DENIALS = "flotilla:admission_denials:rate5m"
RECONCILE_ERRORS = "flotilla:reconcile_errors:rate5m"
RECONCILE_P99 = "flotilla:reconcile_duration_seconds:p99_5m"

# -- alert names ------------------------------------------------------------------------------------------------
ALERT_QUOTA = "FlotillaTenantGPUQuotaNearlyFull"
ALERT_TTFT = "FlotillaServiceTTFTAboveTarget"
ALERT_NOT_READY = "FlotillaServiceNotReady"
ALERT_ENGINE_DOWN = "FlotillaEngineTargetDown"
ALERT_RECONCILE_ERRORS = "FlotillaReconcileErrors"
ALERT_DENIALS = "FlotillaAdmissionDenialsSpike"
ALERT_METERING = "FlotillaMeteringStalled"
ALERT_BUDGET = "FlotillaTenantMonthlyBudgetAtRisk"
ALERT_OPERATOR_DOWN = "FlotillaOperatorDown"

_PROMPT = c.counter_total(c.PROMPT_TOKENS)
_GENERATION = c.counter_total(c.GENERATION_TOKENS)
_HAS_TENANT = f'{{{c.LABEL_TENANT}!=""}}'  # engines outside any Tenant's namespaces export tenant=""
# Hours left in this calendar month (UTC), now included: PromQL's clock functions read time().
_HOURS_LEFT = "24 * (days_in_month() - day_of_month() + 1) - hour() - minute() / 60"


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
            _quantile(q, histogram),
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
        f"  {_rate(c.TIME_TO_FIRST_TOKEN + '_bucket')}\n"
        f"  and on ({SERVICE_BY}, {c.LABEL_LE}) {c.SERVICE_TTFT_TARGET}\n"
        ")\n"
        f"/ (sum by ({SERVICE_BY}) ({_rate(c.TIME_TO_FIRST_TOKEN + '_count')}) > 0)",
        "share of requests whose TTFT met the service's own target (at the bucket boundary at or below it)",
    ),
    Record(
        SERVICE_REQUESTS,
        f"sum by ({SERVICE_BY}) ({_rate(c.counter_total(c.REQUEST_SUCCESS))})",
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
        f"sum by ({SERVICE_BY}) ({_rate(c.counter_total(c.PREFIX_CACHE_HITS))})\n"
        f"/ (sum by ({SERVICE_BY}) ({_rate(c.counter_total(c.PREFIX_CACHE_QUERIES))}) > 0)",
        "prompt tokens found in the prefix cache / prompt tokens looked up",
    ),
    Record(SERVICE_INPUT_TOKENS, f"sum by ({SERVICE_BY}) ({_rate(_PROMPT)})", "prompt tokens per second"),
    Record(
        SERVICE_OUTPUT_TOKENS, f"sum by ({SERVICE_BY}) ({_rate(_GENERATION)})", "generated tokens per second"
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
)

# The operator's tenant series are `max`ed over exporters: one active operator exports them, and a standby
# replica that exported them before must not double them.
TENANT_RULES = (
    Record(
        TENANT_GPUS_ALLOCATED,
        f"max by ({TENANT_TYPE_BY}) ({c.TENANT_GPUS_ALLOCATED})",
        "GPUs held by the tenant's bound pods",
    ),
    Record(TENANT_GPU_QUOTA, f"max by ({TENANT_TYPE_BY}) ({c.TENANT_GPU_QUOTA})", "the tenant's GPU quota"),
    Record(
        TENANT_GPU_QUOTA_USAGE,
        f"{TENANT_GPUS_ALLOCATED} / ({TENANT_GPU_QUOTA} > 0)",
        "allocated / quota; none for a quota of 0",
    ),
    Record(
        TENANT_GPU_HOURS,
        f"sum by ({TENANT_TYPE_BY}) (\n"
        f"  max by ({TENANT_TYPE_BY}, {SERVICE_BY}) ({c.counter_total(c.TENANT_GPU_SECONDS)})\n"
        ") / 3600",
        "GPU-hours, all time (the persisted ledger)",
    ),
    Record(
        TENANT_PRICE,
        f"max by ({TENANT_TYPE_BY}) ({c.TENANT_PRICE_PER_GPU_HOUR})",
        "the Tenant's pricePerGPUHour",
    ),
    Record(
        TENANT_COST_PER_HOUR,
        f"sum by ({TENANT_BY}) ({TENANT_GPUS_ALLOCATED} * on ({TENANT_TYPE_BY}) {TENANT_PRICE})",
        "what the tenant's allocation costs per hour now: allocated GPUs x price",
    ),
    Record(TENANT_COST, f"max by ({TENANT_BY}) ({c.TENANT_COST})", "GPU-hours x price, all time"),
    Record(
        TENANT_MONTH_COST,
        f"max by ({TENANT_BY}) ({c.TENANT_MONTH_COST})",
        "GPU-hours x price, this calendar month (UTC)",
    ),
    Record(
        TENANT_MONTHLY_BUDGET,
        f"max by ({TENANT_BY}) ({c.TENANT_MONTHLY_BUDGET})",
        "the Tenant's monthlyBudget, when set",
    ),
    Record(
        TENANT_MONTH_COST_FORECAST,
        f"{TENANT_MONTH_COST}\n"
        f"+ on ({TENANT_BY}) ({TENANT_COST_PER_HOUR} * scalar({_HOURS_LEFT}))\n"
        f"or {TENANT_MONTH_COST}",
        "this month's cost so far plus the current cost per hour until the month ends",
    ),
    Record(
        TENANT_INPUT_TOKENS,
        f"sum by ({TENANT_BY}) ({_rate(_PROMPT, selector=_HAS_TENANT)})",
        "prompt tokens per second, on the tenant's engines",
    ),
    Record(
        TENANT_OUTPUT_TOKENS,
        f"sum by ({TENANT_BY}) ({_rate(_GENERATION, selector=_HAS_TENANT)})",
        "generated tokens per second, on the tenant's engines",
    ),
    # Cost per token and idle GPUs: over COST_WINDOW, from the GPU-seconds ledger (GPU-seconds per second
    # is the average number of GPUs held) and the engines' token counters.
    Record(
        SERVICE_GPUS,
        f"max by ({TENANT_TYPE_BY}, {SERVICE_BY}) "
        f"({_rate(c.counter_total(c.TENANT_GPU_SECONDS), COST_WINDOW)})",
        f"GPUs held on average over {COST_WINDOW}, per service and GPU type",
    ),
    Record(
        SERVICE_TOKENS,
        f"sum by ({SERVICE_BY}) ({_rate(_PROMPT, COST_WINDOW)})\n"
        f"+ sum by ({SERVICE_BY}) ({_rate(_GENERATION, COST_WINDOW)})",
        f"tokens in and out per second over {COST_WINDOW}",
    ),
    Record(
        TENANT_TOKENS,
        f"sum by ({TENANT_BY}) ({_rate(_PROMPT, COST_WINDOW, _HAS_TENANT)})\n"
        f"+ sum by ({TENANT_BY}) ({_rate(_GENERATION, COST_WINDOW, _HAS_TENANT)})",
        f"tokens in and out per second over {COST_WINDOW}, on the tenant's engines",
    ),
    Record(
        SERVICE_COST_PER_HOUR,
        f"sum by ({TENANT_BY}, {SERVICE_BY}) (\n"
        f"  {SERVICE_GPUS} * on ({TENANT_TYPE_BY}) group_left () {TENANT_PRICE}\n"
        ")",
        f"average cost per hour over {COST_WINDOW}",
    ),
    Record(
        SERVICE_COST_PER_MILLION_TOKENS,
        f"1e6 * {SERVICE_COST_PER_HOUR}\n/ on ({SERVICE_BY}) group_left () (3600 * {SERVICE_TOKENS} > 0)",
        f"cost / tokens x 1e6 over {COST_WINDOW}; none without tokens",
    ),
    Record(
        TENANT_COST_PER_MILLION_TOKENS,
        f"1e6 * sum by ({TENANT_BY}) ({SERVICE_COST_PER_HOUR})\n/ (3600 * {TENANT_TOKENS} > 0)",
        f"cost / tokens x 1e6 over {COST_WINDOW}; none without tokens",
    ),
    # `or 0 * ...`: a tenant whose every GPU served gets 0, not no series.
    Record(
        TENANT_IDLE_GPU_RATIO,
        "(\n"
        f"  sum by ({TENANT_BY}) ({SERVICE_GPUS} unless on ({SERVICE_BY}) ({SERVICE_TOKENS} > 0))\n"
        f"  or 0 * sum by ({TENANT_BY}) ({SERVICE_GPUS})\n"
        ")\n"
        f"/ (sum by ({TENANT_BY}) ({SERVICE_GPUS}) > 0)",
        f"share of the tenant's GPUs (averaged over {COST_WINDOW}) held by services that served no token "
        f"in {COST_WINDOW}",
    ),
    Record(
        TENANT_METERING_LAG,
        f"time() - max by ({TENANT_BY}) ({c.TENANT_LAST_METERED})",
        "seconds since the end of the tenant's last metering round written",
    ),
)

OPERATOR_RULES = (
    Record(
        ADMISSION_DENIALS,
        f"sum by ({c.LABEL_TENANT}, {c.LABEL_REASON}) ({_rate(c.counter_total(c.ADMISSION_DENIALS))})",
        "admission refusals per second",
    ),
    Record(
        RECONCILE_ERRORS,
        f"sum by ({c.LABEL_TRIGGER}) ({_rate(c.counter_total(c.RECONCILE_ERRORS))})",
        "reconciles that raised, per second",
    ),
    Record(
        RECONCILE_P99,
        f"histogram_quantile(0.99,\n"
        f"  sum by ({c.LABEL_LE}) ({_rate(c.RECONCILE_DURATION + '_bucket')})\n"
        f"  and on () (sum({_rate(c.RECONCILE_DURATION + '_count')}) > 0)\n"
        ")",
        "reconcile duration p99; none without reconciles",
    ),
)

_SERVICE = "{{ $labels.namespace }}/{{ $labels.service }}"
_TENANT = "tenant {{ $labels.tenant }}"

ALERTS = (
    Alert(
        ALERT_QUOTA,
        f"{TENANT_GPUS_ALLOCATED} >= {QUOTA_ALERT_RATIO} * {TENANT_GPU_QUOTA}\nand {TENANT_GPUS_ALLOCATED} > 0",
        "15m",
        "warning",
        f"{_TENANT} holds {{{{ $value }}}} {{{{ $labels.gpu_type }}}} GPUs, {QUOTA_ALERT_RATIO:.0%} or more "
        "of its quota",
        "New services and scale-ups of this GPU type will soon be refused by admission, and autoscalers "
        "are clamped (QuotaLimited).",
        "kubectl get tenant {{ $labels.tenant }} -o yaml: compare status.gpusAllocated with "
        "spec.gpuQuota; raise the quota or scale the tenant's services down (flotilla usage --tenant "
        "{{ $labels.tenant }} shows who holds what).",
        signal=f"{TENANT_GPUS_ALLOCATED} >= bool {QUOTA_ALERT_RATIO} * {TENANT_GPU_QUOTA}\n"
        f"and {TENANT_GPUS_ALLOCATED} > bool 0",
    ),
    Alert(
        ALERT_TTFT,
        f"{SERVICE_TTFT_P95} > on ({SERVICE_BY}) {SERVICE_TTFT_TARGET}",
        "10m",
        "warning",
        f"{_SERVICE}: TTFT p95 {{{{ $value | humanizeDuration }}}} is above its target",
        f"Time to first token p95 over {RATE_WINDOW} has been above spec.autoscaling.ttftP95TargetSeconds "
        "for 10 minutes.",
        "kubectl get fisvc -n {{ $labels.namespace }} {{ $labels.service }} -o jsonpath='{.status.autoscaling}'"
        ": ScalingLimited at maxReplicas or QuotaLimited means it cannot grow (raise maxReplicas or the "
        "quota); otherwise check queue depth and KV-cache usage on the service dashboard.",
        signal=f"{SERVICE_TTFT_P95} > bool on ({SERVICE_BY}) {SERVICE_TTFT_TARGET}",
    ),
    Alert(
        ALERT_NOT_READY,
        f"{SERVICE_READY} == 0\nand on ({SERVICE_BY}) {SERVICE_REPLICAS_DESIRED} > 0",
        "10m",
        "warning",
        f"{_SERVICE} is not Ready",
        "The service wants replicas but its Ready condition has been False for 10 minutes.",
        "kubectl describe fisvc -n {{ $labels.namespace }} {{ $labels.service }}: the Valid, "
        "QuotaAdmitted and Degraded conditions say why; then the pods' events and logs "
        "(kubectl get pods -n {{ $labels.namespace }} -l flotilla.dev/inferenceservice={{ $labels.service }}).",
        signal=f"{SERVICE_READY} == bool 0\nand on ({SERVICE_BY}) {SERVICE_REPLICAS_DESIRED} > bool 0",
    ),
    Alert(
        ALERT_ENGINE_DOWN,
        f"up == 0\nand on (job, instance) last_over_time({c.NUM_REQUESTS_RUNNING}[{ENGINE_SEEN_WINDOW}])",
        "5m",
        "warning",
        "Engine target {{ $labels.instance }} ({{ $labels.namespace }}/{{ $labels.pod }}) is down",
        "Prometheus cannot scrape an engine pod that exported engine metrics before: its latency, "
        "tokens and queue are missing from every rule.",
        "kubectl get pod -n {{ $labels.namespace }} {{ $labels.pod }} -o wide and its logs: a crashed or "
        "stuck engine, or a network policy in the way of the scrape; /health answers 503 while loading.",
        signal=f"up == bool 0\n"
        f"and on (job, instance) last_over_time({c.NUM_REQUESTS_RUNNING}[{ENGINE_SEEN_WINDOW}])",
    ),
    Alert(
        ALERT_RECONCILE_ERRORS,
        f"{RECONCILE_ERRORS} > 0",
        "15m",
        "warning",
        "The operator's reconciles keep failing ({{ $labels.trigger }})",
        "Reconciles have raised in every 5-minute window for 15 minutes; kopf retries them with backoff.",
        "Read the operator's log (JSON lines) for 'reconcile failed' and the services' Degraded conditions "
        "(kubectl get fisvc -A); API refusals (RBAC, quotas, webhooks) are the usual cause.",
        signal=f"{RECONCILE_ERRORS} > bool 0",
    ),
    Alert(
        ALERT_DENIALS,
        f"sum by ({c.LABEL_TENANT}, {c.LABEL_REASON}) "
        f"(increase({c.counter_total(c.ADMISSION_DENIALS)}[{DENIAL_WINDOW}])) > {DENIAL_SPIKE}",
        "",
        "warning",
        "Admission refused {{ $value | humanize }} objects ({{ $labels.reason }}) for tenant "
        f'"{{{{ $labels.tenant }}}}" in {DENIAL_WINDOW}',
        f"More than {DENIAL_SPIKE} refusals of one reason in {DENIAL_WINDOW}: a deploy loop, or a client "
        "retrying against a full quota.",
        "The reason names the cause: QuotaExceeded or MaxServicesExceeded, the tenant is full (kubectl get "
        "tenant {{ $labels.tenant }} -o yaml; raise the quota or scale down); GPUTypeNotInQuota or NoTenant, "
        "a namespace or GPU type no Tenant covers; Invalid*, a spec the webhook refuses (the client sees the "
        "message); TenantConflict, a Tenant claiming another's namespace.",
        signal=f"sum by ({c.LABEL_TENANT}, {c.LABEL_REASON}) "
        f"(increase({c.counter_total(c.ADMISSION_DENIALS)}[{DENIAL_WINDOW}])) > bool {DENIAL_SPIKE}",
    ),
    Alert(
        ALERT_METERING,
        f"{TENANT_METERING_LAG} > {METERING_STALE_SECONDS}",
        "5m",
        "warning",
        f"Metering of {_TENANT} stopped advancing",
        "status.lastMeteredTime is {{ $value | humanizeDuration }} old: GPU time is not being written "
        "(nothing is lost; the next successful round covers the gap).",
        "kubectl get tenant {{ $labels.tenant }} -o jsonpath='{.status.lastMeteredTime}' and the "
        "operator's log for 'metering round failed' (API errors, conflicts, RBAC on tenants/status).",
        signal=f"{TENANT_METERING_LAG} > bool {METERING_STALE_SECONDS}",
    ),
    Alert(
        ALERT_BUDGET,
        f"{TENANT_MONTH_COST_FORECAST} > on ({TENANT_BY}) {TENANT_MONTHLY_BUDGET}",
        "30m",
        "warning",
        f"{_TENANT} is on course to pass its monthly budget",
        "This month's cost plus the current allocation's cost until the month ends comes to "
        "{{ $value | humanize }}, above spec.monthlyBudget.",
        "flotilla usage --tenant {{ $labels.tenant }} --since <first of the month> shows where the cost "
        "goes; scale idle services down (see the idle-GPU ratio) or raise spec.monthlyBudget.",
        signal=f"{TENANT_MONTH_COST_FORECAST} > bool on ({TENANT_BY}) {TENANT_MONTHLY_BUDGET}",
    ),
    Alert(
        ALERT_OPERATOR_DOWN,
        f"absent(sum({c.counter_total(c.RECONCILES)}))",
        "5m",
        "critical",
        "No Flotilla operator is being scraped",
        "Nothing reconciles, meters or autoscales, and with the admission webhook on "
        "(failurePolicy Fail) InferenceService writes are refused.",
        "kubectl get pods -n flotilla-system and the operator's log; check that Prometheus scrapes it "
        "(the pod's prometheus.io annotations, --metrics-port).",
        signal=f"sum({c.counter_total(c.RECONCILES)})",
    ),
)

GROUPS = (
    Group("flotilla-service", SERVICE_RULES),
    Group("flotilla-tenant", TENANT_RULES),
    Group("flotilla-operator", OPERATOR_RULES),
    Group("flotilla-alerts", ALERTS),
)


def records() -> list[Record]:
    return [r for g in GROUPS for r in g.rules if isinstance(r, Record)]


def alerts() -> list[Alert]:
    return [r for g in GROUPS for r in g.rules if isinstance(r, Alert)]


def _rule(rule: Record | Alert) -> dict:
    if isinstance(rule, Record):
        return {"record": rule.name, "expr": rule.expr}
    out: dict = {"alert": rule.name, "expr": rule.expr}
    if rule.for_:
        out["for"] = rule.for_
    out["labels"] = {"severity": rule.severity}
    out["annotations"] = {"summary": rule.summary, "description": rule.description, "runbook": rule.runbook}
    return out


def rule_groups(groups: Iterable[Group] = GROUPS) -> list[dict]:
    """The `groups:` list of a rules file, which is also a PrometheusRule's spec.groups."""
    return [{"name": g.name, "rules": [_rule(r) for r in g.rules]} for g in groups]


def prometheus_rule(
    name: str = "flotilla", namespace: str = "flotilla-system", labels: Mapping[str, str] | None = None
) -> dict:
    """The same groups as a prometheus-operator PrometheusRule."""
    meta: dict = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": meta,
        "spec": {"groups": rule_groups()},
    }


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

HEADER = (
    "# Flotilla's Prometheus recording rules and alerts.\n"
    "# Generated by `flotilla monitoring rules` from src/flotilla/monitoring/rules.py: do not edit.\n"
)


def render(groups: Iterable[Group] = GROUPS) -> str:
    """The rules file: groups as Prometheus reads them, each recording rule under a comment saying what it
    records."""
    lines = [HEADER.rstrip("\n"), "groups:"]
    for group in groups:
        lines += [f"  - name: {group.name}", "    rules:"]
        for rule in group.rules:
            if isinstance(rule, Record):
                lines.append(f"      # {rule.doc}")
            text = yaml.dump([_rule(rule)], Dumper=_Dumper, sort_keys=False, width=1000, allow_unicode=True)
            lines += ["      " + line if line else line for line in text.rstrip("\n").split("\n")]
    return "\n".join(lines) + "\n"


# -- what the rules read ----------------------------------------------------------------------------------------
PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
PROMETHEUS_SERIES = {"up"}  # what Prometheus itself records per target


def referenced_series(expr: str) -> set[str]:
    """The series names a PromQL expression reads (functions, keywords, labels and numbers left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?", "", text)  # numbers
    found = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", text):
        if re.match(r"\s*\(", text[match.end() :]) or match.group() in PROMQL_KEYWORDS:
            continue
        found.add(match.group())
    return found


def grouping_labels(expr: str) -> set[str]:
    """The labels an expression aggregates or matches by (by, without, on, ignoring, group_left/right)."""
    found = set()
    for match in re.finditer(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        found.update(label.strip() for label in match.group(1).split(",") if label.strip())
    return found
