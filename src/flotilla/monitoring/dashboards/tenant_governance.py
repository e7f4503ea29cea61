"""The Tenant governance dashboard, per Tenant: GPUs against quota, GPU-hours and cost today and this
month, budget burn, tokens, cost per million tokens, the costliest services, LoRA adapters (tokens,
requests, cost, the adapters running and waiting) and admission refusals.

The "today" and "this month" panels read `$__range` over a time range of their own (`now/d`, `now/M`;
UTC, as metering counts days and months)."""

from __future__ import annotations

from flotilla import contract as c
from flotilla.monitoring import grafana as g
from flotilla.monitoring.dashboards.common import (
    BY_SERVICE,
    NAMESPACE,
    NS_SVC,
    SERVICE,
    SVC,
    TEN,
    TENANT,
    increase,
    sel,
)
from flotilla.monitoring.rules import names as r

TENANT_UID = "flotilla-tenant-governance"
_TENANT_TYPE = "{{tenant}} {{gpu_type}}"
_MONEY = "none"  # a unit for money: the Tenants' price currency, whatever it is (2 decimals)
_TEN_SVC = sel(TENANT, NAMESPACE, SERVICE)
_LEDGER = c.counter_total(c.TENANT_GPU_SECONDS)  # {tenant, namespace, service, gpu_type}
# `max by`: one active operator exports the tenant series; a standby that exported them before must not
# double them (as in the rules).
_LEDGER_KEY = f"{r.TENANT_TYPE_BY}, {BY_SERVICE}"
_ADAPTER = "{{namespace}}/{{service}} {{lora_name}}"
_TEN_NS = sel(TENANT, NAMESPACE)
SVC_BY = BY_SERVICE


def _gpu_seconds() -> str:
    """GPU-seconds per tenant and GPU type over the panel's time range, of the selected namespaces and
    services."""
    return f"sum by ({r.TENANT_TYPE_BY}) (max by ({_LEDGER_KEY}) ({increase(_LEDGER, _TEN_SVC)}))"


def _gpu_hours_stat(title: str, when: str, time_from: str) -> dict:
    return g.stat(
        title,
        f"GPU-hours held {when} (UTC) by the selected tenants' pods, from the metering ledger "
        f"({c.TENANT_GPU_SECONDS}), in the selected namespaces and services.",
        g.target(f"sum({_gpu_seconds()}) / 3600", "GPU-hours"),
        width=4,
        decimals=1,
        time_from=time_from,
    )


def _cost_stat(title: str, when: str, time_from: str) -> dict:
    return g.stat(
        title,
        f"GPU-hours held {when} (UTC) x the Tenant's pricePerGPUHour, in the selected namespaces and "
        "services (the ledger's GPU-seconds at today's prices, as metering prices them).",
        g.target(f"sum({_gpu_seconds()} / 3600 * on ({r.TENANT_TYPE_BY}) {r.TENANT_PRICE}{TEN})", "cost"),
        width=4,
        time_from=time_from,
        unit=_MONEY,
        decimals=2,
    )


def dashboard() -> dict:
    variables = [
        g.variable(TENANT, "Tenant", c.TENANT_COST),  # every Tenant exports its cost
        g.variable(NAMESPACE, "Namespace", _LEDGER, TEN),
        g.variable(SERVICE, "Service", _LEDGER, sel(TENANT, NAMESPACE)),
    ]
    summary = g.row(
        "Today and this month",
        _gpu_hours_stat("GPU-hours today", "since midnight", "now/d"),
        _cost_stat("Cost today", "since midnight", "now/d"),
        _gpu_hours_stat("GPU-hours this month", "since the first of the month", "now/M"),
        g.stat(
            "Cost this month",
            "GPU-hours x price this calendar month (UTC), all of the selected tenants' services "
            f"({r.TENANT_MONTH_COST}).",
            g.target(f"sum({r.TENANT_MONTH_COST}{TEN})", "cost"),
            width=4,
            unit=_MONEY,
            decimals=2,
        ),
        g.stat(
            "Month forecast",
            "This month's cost so far plus the current allocation's cost per hour until the month ends "
            f"({r.TENANT_MONTH_COST_FORECAST}).",
            g.target(f"sum({r.TENANT_MONTH_COST_FORECAST}{TEN})", "forecast"),
            width=4,
            unit=_MONEY,
            decimals=2,
        ),
        g.stat(
            "Cost per hour now",
            f"What the selected tenants' allocation costs per hour now: allocated GPUs x price "
            f"({r.TENANT_COST_PER_HOUR}).",
            g.target(f"sum({r.TENANT_COST_PER_HOUR}{TEN})", "per hour"),
            width=4,
            unit=_MONEY,
            decimals=2,
        ),
    )
    quota = g.row(
        "GPUs and quota",
        g.timeseries(
            "GPUs allocated against quota",
            "GPUs held by each tenant's bound pods and its gpuQuota, per GPU type.",
            g.target(f"{r.TENANT_GPUS_ALLOCATED}{TEN}", f"allocated {_TENANT_TYPE}"),
            g.target(f"{r.TENANT_GPU_QUOTA}{TEN}", f"quota {_TENANT_TYPE}"),
            width=12,
            decimals=0,
        ),
        g.gauge(
            "Quota used",
            f"Allocated / quota per tenant and GPU type; red from {r.QUOTA_ALERT_RATIO:.0%}, where the "
            f"{r.ALERT_QUOTA} alert fires after 15 minutes.",
            g.target(f"{r.TENANT_GPU_QUOTA_USAGE}{TEN}", _TENANT_TYPE),
            width=6,
            steps=((r.QUOTA_ALERT_RATIO, "red"),),
        ),
        g.stat(
            "Metering lag",
            "Seconds since the end of each tenant's last metering round written to its status; red past "
            f"{r.METERING_STALE_SECONDS} s ({r.ALERT_METERING}).",
            g.target(f"{r.TENANT_METERING_LAG}{TEN}", "{{tenant}}"),
            unit="s",
            width=6,
            height=8,
            steps=((r.METERING_STALE_SECONDS, "red"),),
        ),
        g.timeseries(
            "GPUs held per service",
            f"GPUs each service held on average over {r.COST_WINDOW}, per GPU type (from the metering ledger).",
            g.target(f"{r.SERVICE_GPUS}{_TEN_SVC}", f"{NS_SVC} {{{{gpu_type}}}}"),
            width=24,
        ),
    )
    cost = g.row(
        "Cost and budget",
        g.timeseries(
            "Month cost, forecast and budget",
            "Budget burn: this month's cost so far, the forecast to the end of the month and the "
            f"monthlyBudget, per tenant. {r.ALERT_BUDGET} fires when the forecast stays above the budget.",
            g.target(f"{r.TENANT_MONTH_COST}{TEN}", "cost {{tenant}}"),
            g.target(f"{r.TENANT_MONTH_COST_FORECAST}{TEN}", "forecast {{tenant}}"),
            g.target(f"{r.TENANT_MONTHLY_BUDGET}{TEN}", "budget {{tenant}}"),
            width=12,
            unit=_MONEY,
            decimals=2,
        ),
        g.gauge(
            "Budget burn",
            "This month's cost and its forecast as a share of the monthlyBudget, per tenant that sets one; "
            "red at the budget.",
            g.target(
                f"{r.TENANT_MONTH_COST}{TEN} / on ({r.TENANT_BY}) ({r.TENANT_MONTHLY_BUDGET}{TEN} > 0)",
                "spent {{tenant}}",
            ),
            g.target(
                f"{r.TENANT_MONTH_COST_FORECAST}{TEN} / on ({r.TENANT_BY}) "
                f"({r.TENANT_MONTHLY_BUDGET}{TEN} > 0)",
                "forecast {{tenant}}",
            ),
            width=12,
            max_=1.5,
            steps=((0.8, "orange"), (1.0, "red")),
        ),
        g.timeseries(
            "Cost per hour",
            "What each tenant's allocation costs per hour: allocated GPUs x pricePerGPUHour.",
            g.target(f"{r.TENANT_COST_PER_HOUR}{TEN}", "{{tenant}}"),
            width=12,
            unit=_MONEY,
            decimals=2,
        ),
        g.bargauge(
            "Top services by cost",
            f"The 10 services that cost most per hour, averaged over {r.COST_WINDOW} (their GPUs x price).",
            g.target(f"topk(10, {r.SERVICE_COST_PER_HOUR}{_TEN_SVC})", NS_SVC),
            width=12,
            unit=_MONEY,
            decimals=2,
        ),
        g.timeseries(
            "Cost per million tokens",
            f"Each tenant's GPU cost over {r.COST_WINDOW} / its tokens in and out, x 1e6; no line without "
            "tokens (idle GPUs show on the Fleet dashboard).",
            g.target(f"{r.TENANT_COST_PER_MILLION_TOKENS}{TEN}", "{{tenant}}"),
            width=12,
            unit=_MONEY,
            decimals=2,
        ),
        g.table(
            "Services: cost and tokens",
            f"Per service over {r.COST_WINDOW}: cost per hour, tokens in and out per second and cost per "
            "million tokens.",
            {
                "Cost per hour": g.target(f"{r.SERVICE_COST_PER_HOUR}{_TEN_SVC}"),
                # The token rule has no `tenant`: take it from the cost rule (`group` is 1), so the
                # rows merge.
                "Tokens/s": g.target(
                    f"{r.SERVICE_TOKENS}{SVC} * on ({BY_SERVICE}) group_left ({TENANT})\n"
                    f"group by ({TENANT}, {BY_SERVICE}) ({r.SERVICE_COST_PER_HOUR}{_TEN_SVC})"
                ),
                "Cost per 1M tokens": g.target(f"{r.SERVICE_COST_PER_MILLION_TOKENS}{_TEN_SVC}"),
            },
            labels=(TENANT, NAMESPACE, SERVICE),
            width=12,
            decimals=2,
        ),
    )
    tokens = g.row(
        "Tokens",
        g.timeseries(
            "Tokens per second",
            f"Prompt tokens processed and tokens generated per second on each tenant's engines, over "
            f"{r.RATE_WINDOW}.",
            g.target(f"{r.TENANT_INPUT_TOKENS}{TEN}", "in {{tenant}}"),
            g.target(f"{r.TENANT_OUTPUT_TOKENS}{TEN}", "out {{tenant}}"),
            width=16,
        ),
        g.stat(
            "Tokens today",
            f"Tokens in and out since midnight (UTC), as metered into the Tenants' status ({c.TENANT_METERED_TOKENS}).",
            g.target(
                f"sum by ({c.LABEL_DIRECTION}) (max by ({r.TENANT_BY}, {c.LABEL_DIRECTION}) "
                f"({increase(c.counter_total(c.TENANT_METERED_TOKENS), TEN)}))",
                f"{{{{{c.LABEL_DIRECTION}}}}}",
            ),
            width=8,
            height=8,
            time_from="now/d",
        ),
    )
    adapters = g.row(
        "LoRA adapters",
        g.timeseries(
            "Adapter tokens per second",
            f"Prompt tokens and generated tokens per second with each LoRA adapter, over {r.RATE_WINDOW}, on "
            "the selected services' engines (their per-adapter counters; docs/lora.md).",
            g.target(f"{r.ADAPTER_INPUT_TOKENS}{SVC}", f"in {_ADAPTER}"),
            g.target(f"{r.ADAPTER_OUTPUT_TOKENS}{SVC}", f"out {_ADAPTER}"),
            width=12,
        ),
        g.timeseries(
            "Adapter requests per second",
            f"Requests finished per second with each LoRA adapter, over {r.RATE_WINDOW}.",
            g.target(f"{r.ADAPTER_REQUESTS}{SVC}", _ADAPTER),
            unit="reqps",
            width=12,
        ),
        g.bargauge(
            "Adapter tokens today",
            "Tokens in and out per LoRAAdapter since midnight (UTC), as metered into the Tenants' status "
            f"({c.TENANT_ADAPTER_TOKENS}).",
            g.target(
                f"sum by ({r.TENANT_ADAPTER_BY}) (max by ({r.TENANT_ADAPTER_BY}, {c.LABEL_DIRECTION}) "
                f"({increase(c.counter_total(c.TENANT_ADAPTER_TOKENS), _TEN_NS)}))",
                "{{tenant}} {{namespace}}/{{lora_name}}",
            ),
            width=8,
            decimals=0,
            time_from="now/d",
        ),
        g.bargauge(
            "Adapter cost",
            "Each LoRAAdapter's tokens (all time) x its tenant's cost per million tokens: its share of the "
            f"tenant's GPU cost ({r.TENANT_ADAPTER_COST}).",
            g.target(f"{r.TENANT_ADAPTER_COST}{_TEN_NS}", "{{tenant}} {{namespace}}/{{lora_name}}"),
            width=8,
            unit=_MONEY,
            decimals=2,
        ),
        g.table(
            "Adapters running and waiting",
            "Engine replicas by the LoRA adapters of their running requests and of their waiting ones "
            f"({c.LORA_REQUESTS_INFO}; an empty cell: none).",
            {
                "Replicas": g.target(
                    f"count by ({SVC_BY}, {c.LABEL_RUNNING_LORA_ADAPTERS}, {c.LABEL_WAITING_LORA_ADAPTERS}) "
                    f"({c.LORA_REQUESTS_INFO}{SVC})"
                )
            },
            labels=(NAMESPACE, SERVICE, c.LABEL_RUNNING_LORA_ADAPTERS, c.LABEL_WAITING_LORA_ADAPTERS),
            width=8,
            decimals=0,
        ),
    )
    admission = g.row(
        "Admission",
        g.timeseries(
            "Admission denials",
            "Objects the admission webhook refused per second, by tenant and reason (QuotaExceeded, "
            "MaxServicesExceeded, GPUTypeNotInQuota, NoTenant, Invalid*, TenantConflict).",
            g.target(f"{r.ADMISSION_DENIALS}{TEN}", "{{tenant}} {{reason}}"),
            unit="ops",
            width=16,
        ),
        g.bargauge(
            "Denials in the time range",
            "Refusals over the dashboard's time range, by reason.",
            g.target(
                f"sum by ({c.LABEL_REASON}) ({increase(c.counter_total(c.ADMISSION_DENIALS), TEN)}) > 0",
                "{{reason}}",
            ),
            width=8,
            decimals=0,
        ),
    )
    return g.dashboard(
        TENANT_UID,
        "Flotilla / Tenant governance",
        "Per Tenant: GPUs against quota, GPU-hours and cost today and this month, budget burn, tokens, cost "
        "per million tokens, the costliest services, LoRA adapters and admission refusals. Money is in the Tenants' "
        "price currency; days and months are UTC, as metering counts them.",
        variables,
        [summary, quota, cost, tokens, adapters, admission],
        tags=["governance"],
        time_from="now-24h",
    )
