"""The per-tenant recording rules, keyed by `tenant` (and `gpu_type`): GPUs against quota, GPU-hours,
cost and its forecast, budget, tokens, cost per token, idle GPUs and metering lag. The per-service cost
series also carry `tenant`."""

from __future__ import annotations

from flotilla import contract as c
from flotilla.monitoring.rules.model import GENERATION, HAS_TENANT, PROMPT, Record, rate
from flotilla.monitoring.rules.names import (
    COST_WINDOW,
    SERVICE_BY,
    SERVICE_COST_PER_HOUR,
    SERVICE_COST_PER_MILLION_TOKENS,
    SERVICE_GPUS,
    SERVICE_TOKENS,
    TENANT_ADAPTER_BY,
    TENANT_ADAPTER_COST,
    TENANT_BY,
    TENANT_COST,
    TENANT_COST_PER_HOUR,
    TENANT_COST_PER_MILLION_TOKENS,
    TENANT_GPU_HOURS,
    TENANT_GPU_QUOTA,
    TENANT_GPU_QUOTA_USAGE,
    TENANT_GPUS_ALLOCATED,
    TENANT_IDLE_GPU_RATIO,
    TENANT_INPUT_TOKENS,
    TENANT_METERING_LAG,
    TENANT_MONTH_COST,
    TENANT_MONTH_COST_FORECAST,
    TENANT_MONTHLY_BUDGET,
    TENANT_OUTPUT_TOKENS,
    TENANT_PRICE,
    TENANT_TOKENS,
    TENANT_TYPE_BY,
)

# Hours left in this calendar month (UTC), now included: PromQL's clock functions read time().
_HOURS_LEFT = "24 * (days_in_month() - day_of_month() + 1) - hour() - minute() / 60"

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
        f"sum by ({TENANT_BY}) ({rate(PROMPT, selector=HAS_TENANT)})",
        "prompt tokens per second, on the tenant's engines",
    ),
    Record(
        TENANT_OUTPUT_TOKENS,
        f"sum by ({TENANT_BY}) ({rate(GENERATION, selector=HAS_TENANT)})",
        "generated tokens per second, on the tenant's engines",
    ),
    # Cost per token and idle GPUs: over COST_WINDOW, from the GPU-seconds ledger (GPU-seconds per second
    # is the average number of GPUs held) and the engines' token counters.
    Record(
        SERVICE_GPUS,
        f"max by ({TENANT_TYPE_BY}, {SERVICE_BY}) "
        f"({rate(c.counter_total(c.TENANT_GPU_SECONDS), COST_WINDOW)})",
        f"GPUs held on average over {COST_WINDOW}, per service and GPU type",
    ),
    Record(
        SERVICE_TOKENS,
        f"sum by ({SERVICE_BY}) ({rate(PROMPT, COST_WINDOW)})\n"
        f"+ sum by ({SERVICE_BY}) ({rate(GENERATION, COST_WINDOW)})",
        f"tokens in and out per second over {COST_WINDOW}",
    ),
    Record(
        TENANT_TOKENS,
        f"sum by ({TENANT_BY}) ({rate(PROMPT, COST_WINDOW, HAS_TENANT)})\n"
        f"+ sum by ({TENANT_BY}) ({rate(GENERATION, COST_WINDOW, HAS_TENANT)})",
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
        TENANT_ADAPTER_COST,
        f"max by ({TENANT_ADAPTER_BY}) ({c.TENANT_ADAPTER_COST})",
        "a LoRAAdapter's tokens x the tenant's cost per million tokens, all time (metering)",
    ),
    Record(
        TENANT_METERING_LAG,
        f"time() - max by ({TENANT_BY}) ({c.TENANT_LAST_METERED})",
        "seconds since the end of the tenant's last metering round written",
    ),
)
