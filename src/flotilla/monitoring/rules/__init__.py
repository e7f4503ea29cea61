"""Flotilla's Prometheus recording rules and alerts, as data: the one source of the rules file
(deploy/monitoring/flotilla-rules.yaml, `flotilla monitoring rules`), of a PrometheusRule
(`prometheus_rule`) and of the dashboards, which import the recorded names.

One job a module: names (recorded and alert names, windows, thresholds), model (Record, Alert, Group and
the PromQL pieces the rules share), service, tenant and operator (the recording rules by subject),
alerting (the alerts), groups (the rule groups in order), rendering (the rules file and the
PrometheusRule) and promql (what an expression reads, for the tests). This package re-exports their
public names.

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
"""

from __future__ import annotations

from flotilla.monitoring.rules.alerting import ALERTS
from flotilla.monitoring.rules.groups import GROUPS, alerts, records
from flotilla.monitoring.rules.model import Alert, Group, Record
from flotilla.monitoring.rules.names import (
    ADMISSION_DENIALS,
    ALERT_BUDGET,
    ALERT_DENIALS,
    ALERT_ENGINE_DOWN,
    ALERT_METERING,
    ALERT_NOT_READY,
    ALERT_OPERATOR_DOWN,
    ALERT_QUOTA,
    ALERT_RECONCILE_ERRORS,
    ALERT_TTFT,
    COST_WINDOW,
    DENIAL_SPIKE,
    DENIAL_WINDOW,
    ENGINE_SEEN_WINDOW,
    METERING_STALE_SECONDS,
    QUOTA_ALERT_RATIO,
    RATE_WINDOW,
    RECONCILE_ERRORS,
    RECONCILE_P99,
    SERVICE_BY,
    SERVICE_COST_PER_HOUR,
    SERVICE_COST_PER_MILLION_TOKENS,
    SERVICE_E2E_P50,
    SERVICE_E2E_P95,
    SERVICE_E2E_P99,
    SERVICE_GPUS,
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
    SERVICE_TOKENS,
    SERVICE_TTFT_P50,
    SERVICE_TTFT_P95,
    SERVICE_TTFT_P99,
    SERVICE_TTFT_SLO,
    SERVICE_TTFT_TARGET,
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
from flotilla.monitoring.rules.operator import OPERATOR_RULES
from flotilla.monitoring.rules.promql import (
    PROMETHEUS_SERIES,
    PROMQL_KEYWORDS,
    grouping_labels,
    referenced_series,
)
from flotilla.monitoring.rules.rendering import HEADER, prometheus_rule, render, rule_groups
from flotilla.monitoring.rules.service import SERVICE_RULES
from flotilla.monitoring.rules.tenant import TENANT_RULES

__all__ = [
    "ADMISSION_DENIALS",
    "ALERTS",
    "ALERT_BUDGET",
    "ALERT_DENIALS",
    "ALERT_ENGINE_DOWN",
    "ALERT_METERING",
    "ALERT_NOT_READY",
    "ALERT_OPERATOR_DOWN",
    "ALERT_QUOTA",
    "ALERT_RECONCILE_ERRORS",
    "ALERT_TTFT",
    "Alert",
    "COST_WINDOW",
    "DENIAL_SPIKE",
    "DENIAL_WINDOW",
    "ENGINE_SEEN_WINDOW",
    "GROUPS",
    "Group",
    "HEADER",
    "METERING_STALE_SECONDS",
    "OPERATOR_RULES",
    "PROMETHEUS_SERIES",
    "PROMQL_KEYWORDS",
    "QUOTA_ALERT_RATIO",
    "RATE_WINDOW",
    "RECONCILE_ERRORS",
    "RECONCILE_P99",
    "Record",
    "SERVICE_BY",
    "SERVICE_COST_PER_HOUR",
    "SERVICE_COST_PER_MILLION_TOKENS",
    "SERVICE_E2E_P50",
    "SERVICE_E2E_P95",
    "SERVICE_E2E_P99",
    "SERVICE_GPUS",
    "SERVICE_INPUT_TOKENS",
    "SERVICE_ITL_P50",
    "SERVICE_ITL_P95",
    "SERVICE_ITL_P99",
    "SERVICE_KV_CACHE_USAGE",
    "SERVICE_OUTPUT_TOKENS",
    "SERVICE_PREFIX_CACHE_HIT",
    "SERVICE_QUEUE_DEPTH",
    "SERVICE_READY",
    "SERVICE_REPLICAS_DESIRED",
    "SERVICE_REPLICAS_READY",
    "SERVICE_REPLICAS_READY_RATIO",
    "SERVICE_REQUESTS",
    "SERVICE_RULES",
    "SERVICE_RUNNING",
    "SERVICE_TOKENS",
    "SERVICE_TTFT_P50",
    "SERVICE_TTFT_P95",
    "SERVICE_TTFT_P99",
    "SERVICE_TTFT_SLO",
    "SERVICE_TTFT_TARGET",
    "TENANT_BY",
    "TENANT_COST",
    "TENANT_COST_PER_HOUR",
    "TENANT_COST_PER_MILLION_TOKENS",
    "TENANT_GPUS_ALLOCATED",
    "TENANT_GPU_HOURS",
    "TENANT_GPU_QUOTA",
    "TENANT_GPU_QUOTA_USAGE",
    "TENANT_IDLE_GPU_RATIO",
    "TENANT_INPUT_TOKENS",
    "TENANT_METERING_LAG",
    "TENANT_MONTHLY_BUDGET",
    "TENANT_MONTH_COST",
    "TENANT_MONTH_COST_FORECAST",
    "TENANT_OUTPUT_TOKENS",
    "TENANT_PRICE",
    "TENANT_RULES",
    "TENANT_TOKENS",
    "TENANT_TYPE_BY",
    "alerts",
    "grouping_labels",
    "prometheus_rule",
    "records",
    "referenced_series",
    "render",
    "rule_groups",
]
