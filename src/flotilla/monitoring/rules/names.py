"""The names the rules record and alert under, and their windows and thresholds: what the dashboards
import. Recorded series are named `flotilla:<level>_<what>[:<operation>]`; per-service ones are keyed by
`namespace` and `service` (SERVICE_BY), per-tenant ones by `tenant` (and `gpu_type`)."""

from __future__ import annotations

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
ADAPTER_BY = f"{SERVICE_BY}, {c.LABEL_LORA_NAME}"  # a LoRA adapter on a service (its engines' series)
TENANT_ADAPTER_BY = f"{c.LABEL_TENANT}, {c.LABEL_NAMESPACE}, {c.LABEL_LORA_NAME}"  # a tenant's LoRAAdapter

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
# Per LoRA adapter on a service {namespace, service, lora_name}, from the engines' per-adapter counters.
ADAPTER_INPUT_TOKENS = "flotilla:adapter_input_tokens:rate5m"
ADAPTER_OUTPUT_TOKENS = "flotilla:adapter_output_tokens:rate5m"
ADAPTER_REQUESTS = "flotilla:adapter_requests:rate5m"
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
# Per tenant's LoRAAdapter {tenant, namespace, lora_name}, from metering (Tenant.status.adapters).
TENANT_ADAPTER_COST = "flotilla:tenant_adapter_cost"
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
ALERT_RATE_LIMIT_STORE = "FlotillaGatewayRateLimitStoreFailing"
