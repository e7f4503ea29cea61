"""Tenant series for Prometheus, from the figures metering last wrote to Tenant.status.

A collector, not counters in memory: flotilla_tenant_gpu_seconds_total is the persisted ledger, so it
carries on across operator restarts instead of starting again from zero.
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from flotilla.operator.api.v1alpha1 import TenantStatus


class TenantCollector:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tenants: dict[str, TenantStatus] = {}

    def update(self, tenant: str, status: TenantStatus) -> None:
        with self._lock:
            self._tenants[tenant] = status

    def forget(self, tenant: str) -> None:
        with self._lock:
            self._tenants.pop(tenant, None)

    def collect(self):
        with self._lock:
            tenants = dict(self._tenants)
        seconds = CounterMetricFamily(
            "flotilla_tenant_gpu_seconds",
            "GPU-seconds held by a tenant's pods (GPUs x time from binding to termination)",
            labels=["tenant", "namespace", "service", "gpu_type"],
        )
        allocated = GaugeMetricFamily(
            "flotilla_tenant_gpus_allocated",
            "GPUs held by a tenant's bound pods",
            labels=["tenant", "gpu_type"],
        )
        quota = GaugeMetricFamily(
            "flotilla_tenant_gpu_quota", "a tenant's GPU quota", labels=["tenant", "gpu_type"]
        )
        cost = GaugeMetricFamily("flotilla_tenant_cost", "GPU-hours x price, all time", labels=["tenant"])
        tokens = CounterMetricFamily(
            "flotilla_tenant_tokens",
            "tokens served, from the engines' counters",
            labels=["tenant", "direction"],
        )
        for tenant, status in sorted(tenants.items()):
            for key, value in sorted(status.ledger.total.items()):
                seconds.add_metric([tenant, *key.split("/", 2)], value)
            for gpu_type in sorted(set(status.gpu_quota) | set(status.gpus_allocated)):
                allocated.add_metric([tenant, gpu_type], status.gpus_allocated.get(gpu_type, 0))
            for gpu_type, value in sorted(status.gpu_quota.items()):
                quota.add_metric([tenant, gpu_type], value)
            cost.add_metric([tenant], status.cost)
            tokens.add_metric([tenant, "input"], status.tokens.input)
            tokens.add_metric([tenant, "output"], status.tokens.output)
        yield from (seconds, allocated, quota, cost, tokens)


TENANTS = TenantCollector()
REGISTRY.register(TENANTS)
