"""Flotilla's alerts: each with its runbook line and its `signal`, what it watches whether it fires or
not."""

from __future__ import annotations

from flotilla import contract as c
from flotilla.monitoring.rules.model import Alert
from flotilla.monitoring.rules.names import (
    ALERT_BUDGET,
    ALERT_DENIALS,
    ALERT_ENGINE_DOWN,
    ALERT_METERING,
    ALERT_NOT_READY,
    ALERT_OPERATOR_DOWN,
    ALERT_QUOTA,
    ALERT_RATE_LIMIT_STORE,
    ALERT_RECONCILE_ERRORS,
    ALERT_TTFT,
    DENIAL_SPIKE,
    DENIAL_WINDOW,
    ENGINE_SEEN_WINDOW,
    METERING_STALE_SECONDS,
    QUOTA_ALERT_RATIO,
    RATE_WINDOW,
    RECONCILE_ERRORS,
    SERVICE_BY,
    SERVICE_READY,
    SERVICE_REPLICAS_DESIRED,
    SERVICE_TTFT_P95,
    SERVICE_TTFT_TARGET,
    TENANT_BY,
    TENANT_GPU_QUOTA,
    TENANT_GPUS_ALLOCATED,
    TENANT_METERING_LAG,
    TENANT_MONTH_COST_FORECAST,
    TENANT_MONTHLY_BUDGET,
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
    Alert(
        ALERT_RATE_LIMIT_STORE,
        f"sum by (instance) (increase({c.counter_total(c.GATEWAY_RATE_LIMIT_STORE_ERRORS)}[5m])) > 0",
        "5m",
        "warning",
        "Gateway {{ $labels.instance }} cannot reach its rate-limit Redis",
        "Its rate-limit decisions have failed over to its own buckets for 5 minutes: each gateway replica "
        "counts tenants' limits alone, so a tenant may get up to N times its limits over N replicas.",
        "Check the Redis the chart's gateway.rateLimitRedis names (reachable from the gateway pods, not "
        "out of memory) and the gateway's log for 'rate-limit store'; the limits are global again within "
        "seconds of Redis answering.",
        signal=f"sum by (instance) (increase({c.counter_total(c.GATEWAY_RATE_LIMIT_STORE_ERRORS)}[5m])) > bool 0",
    ),
)
