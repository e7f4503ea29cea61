"""Tenant series for Prometheus, from the figures metering last wrote to Tenant.status and the Tenant's spec.

A collector, not counters in memory: flotilla_tenant_gpu_seconds_total is the persisted ledger, so it
carries on across operator restarts instead of starting again from zero. The metering daemon seeds it from
the stored status when it starts, so a Tenant whose metering never succeeds after a restart still shows its
last metering time (and the staleness alert sees it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from flotilla.contract import (
    LABEL_DIRECTION,
    LABEL_GPU_TYPE,
    LABEL_LORA_NAME,
    LABEL_NAMESPACE,
    LABEL_SERVICE,
    LABEL_TENANT,
    TENANT_ADAPTER_COST,
    TENANT_ADAPTER_TOKENS,
    TENANT_COST,
    TENANT_GPU_QUOTA,
    TENANT_GPU_SECONDS,
    TENANT_GPUS_ALLOCATED,
    TENANT_LAST_METERED,
    TENANT_METERED_TOKENS,
    TENANT_MONTH_COST,
    TENANT_MONTHLY_BUDGET,
    TENANT_PRICE_PER_GPU_HOUR,
)
from flotilla.operator.api.v1alpha1 import TenantSpec, TenantStatus
from flotilla.operator.tenancy.metering import cost, parse_time, usage_views


def month_cost(status: TenantStatus, spec: TenantSpec, now: float) -> float:
    """This calendar month's (UTC) GPU-hours x the current prices, from the ledger's day buckets. Derived
    at `now`, not read from status.usage.month, so a new month starts at zero even before metering writes."""
    return cost(usage_views(status.ledger, now).month.by_gpu_type, spec.price_per_gpu_hour)


class TenantCollector:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._tenants: dict[str, tuple[TenantStatus, TenantSpec]] = {}
        self._clock = clock

    def update(self, tenant: str, status: TenantStatus, spec: TenantSpec) -> None:
        with self._lock:
            self._tenants[tenant] = (status, spec)

    def forget(self, tenant: str) -> None:
        with self._lock:
            self._tenants.pop(tenant, None)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self._lock:
            tenants = dict(self._tenants)
        now = self._clock()
        by_type = [LABEL_TENANT, LABEL_GPU_TYPE]
        seconds = CounterMetricFamily(
            TENANT_GPU_SECONDS,
            "GPU-seconds held by a tenant's pods (GPUs x time from binding to termination)",
            labels=[LABEL_TENANT, LABEL_NAMESPACE, LABEL_SERVICE, LABEL_GPU_TYPE],
        )
        allocated = GaugeMetricFamily(
            TENANT_GPUS_ALLOCATED, "GPUs held by a tenant's bound pods", labels=by_type
        )
        quota = GaugeMetricFamily(TENANT_GPU_QUOTA, "a tenant's GPU quota", labels=by_type)
        price = GaugeMetricFamily(
            TENANT_PRICE_PER_GPU_HOUR, "the Tenant's spec.pricePerGPUHour", labels=by_type
        )
        total_cost = GaugeMetricFamily(TENANT_COST, "GPU-hours x price, all time", labels=[LABEL_TENANT])
        this_month = GaugeMetricFamily(
            TENANT_MONTH_COST, "GPU-hours x price, this calendar month (UTC)", labels=[LABEL_TENANT]
        )
        budget = GaugeMetricFamily(
            TENANT_MONTHLY_BUDGET, "the Tenant's spec.monthlyBudget (only when set)", labels=[LABEL_TENANT]
        )
        metered = GaugeMetricFamily(
            TENANT_LAST_METERED,
            "status.lastMeteredTime as a Unix timestamp: the end of the last metering round written",
            labels=[LABEL_TENANT],
        )
        tokens = CounterMetricFamily(
            TENANT_METERED_TOKENS,
            "tokens served, from the engines' counters",
            labels=[LABEL_TENANT, LABEL_DIRECTION],
        )
        per_adapter = [LABEL_TENANT, LABEL_NAMESPACE, LABEL_LORA_NAME]
        adapter_tokens = CounterMetricFamily(
            TENANT_ADAPTER_TOKENS,
            "tokens served with a LoRA adapter, from the engines' per-adapter counters",
            labels=[*per_adapter, LABEL_DIRECTION],
        )
        adapter_cost = GaugeMetricFamily(
            TENANT_ADAPTER_COST,
            "a LoRA adapter's tokens x the tenant's cost per million tokens, all time",
            labels=per_adapter,
        )
        for tenant, (status, spec) in sorted(tenants.items()):
            for key, usage in sorted(status.adapters.items()):
                namespace, adapter = key.split("/", 1)
                adapter_tokens.add_metric([tenant, namespace, adapter, "input"], usage.input)
                adapter_tokens.add_metric([tenant, namespace, adapter, "output"], usage.output)
                adapter_cost.add_metric([tenant, namespace, adapter], usage.cost)
            for key, value in sorted(status.ledger.total.items()):
                seconds.add_metric([tenant, *key.split("/", 2)], value)
            for gpu_type in sorted(set(status.gpu_quota) | set(status.gpus_allocated)):
                allocated.add_metric([tenant, gpu_type], status.gpus_allocated.get(gpu_type, 0))
            for gpu_type, value in sorted(status.gpu_quota.items()):
                quota.add_metric([tenant, gpu_type], value)
            for gpu_type, value in sorted(spec.price_per_gpu_hour.items()):
                price.add_metric([tenant, gpu_type], value)
            total_cost.add_metric([tenant], status.cost)
            this_month.add_metric([tenant], round(month_cost(status, spec, now), 6))
            if spec.monthly_budget is not None:
                budget.add_metric([tenant], spec.monthly_budget)
            stamp = parse_time(status.last_metered_time)
            if stamp is not None:
                metered.add_metric([tenant], stamp)
            tokens.add_metric([tenant, "input"], status.tokens.input)
            tokens.add_metric([tenant, "output"], status.tokens.output)
        yield from (seconds, allocated, quota, price, total_cost, this_month, budget, metered, tokens)
        yield from (adapter_tokens, adapter_cost)


TENANTS = TenantCollector()
REGISTRY.register(TENANTS)
