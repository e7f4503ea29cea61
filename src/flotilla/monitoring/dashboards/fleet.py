"""The Fleet dashboard: GPUs allocated and free under quota by GPU type and tenant, the idle GPU share,
services by state, and the operator's health (reconciles, errors, latency, API calls, webhook
refusals)."""

from __future__ import annotations

from flotilla import contract as c
from flotilla.monitoring import grafana as g
from flotilla.monitoring.dashboards.common import BY_SERVICE, NAMESPACE, SERVICE, TEN, TENANT, rate, sel
from flotilla.monitoring.rules import names as r

FLEET_UID = "flotilla-fleet"
_SVC_NS = sel(NAMESPACE)
_OPERATOR = f"{c.counter_total(c.RECONCILES)}"  # every operator exports it (one series per trigger)


def _services_in(state: str) -> str:
    desired = f"{r.SERVICE_REPLICAS_DESIRED}{_SVC_NS}"
    ready = f"{r.SERVICE_READY}{_SVC_NS}"
    expr = {
        "ready": f"{ready} == 1 and on ({BY_SERVICE}) {desired} > 0",
        "not ready": f"{ready} == 0 and on ({BY_SERVICE}) {desired} > 0",
        "scaled to zero": f"{desired} == 0",
    }[state]
    return f"count({expr}) or vector(0)"


def dashboard() -> dict:
    variables = [
        g.variable(TENANT, "Tenant", c.TENANT_COST),
        g.variable(NAMESPACE, "Namespace", c.SERVICE_DESIRED_REPLICAS),
    ]
    headroom = f"{r.TENANT_GPU_QUOTA}{TEN} - {r.TENANT_GPUS_ALLOCATED}{TEN}"
    gpus = g.row(
        "GPUs",
        g.stat(
            "GPUs allocated",
            "GPUs held by the selected tenants' bound pods, all GPU types.",
            g.target(f"sum({r.TENANT_GPUS_ALLOCATED}{TEN})", "allocated"),
            width=6,
            decimals=0,
        ),
        g.stat(
            "GPUs free under quota",
            "Quota not allocated, summed over the selected tenants and GPU types (negative: over quota). "
            "The operator exports allocation per tenant and GPU type, not node capacity.",
            g.target(f"sum({headroom})", "free"),
            width=6,
            decimals=0,
        ),
        g.stat(
            "Idle GPU share",
            f"Share of the selected tenants' GPUs (averaged over {r.COST_WINDOW}) held by services that "
            f"served no token in {r.COST_WINDOW}: each tenant's idle ratio weighted by its GPUs.",
            g.target(
                f"sum({r.TENANT_IDLE_GPU_RATIO}{TEN} * on ({r.TENANT_BY}) "
                f"sum by ({r.TENANT_BY}) ({r.SERVICE_GPUS}{TEN}))\n"
                f"/ (sum({r.SERVICE_GPUS}{TEN}) > 0)",
                "idle",
            ),
            unit="percentunit",
            width=6,
            steps=((0.25, "orange"), (0.5, "red")),
        ),
        g.stat(
            "Quota used",
            "Allocated / quota over the selected tenants and all GPU types.",
            g.target(f"sum({r.TENANT_GPUS_ALLOCATED}{TEN}) / (sum({r.TENANT_GPU_QUOTA}{TEN}) > 0)", "used"),
            unit="percentunit",
            width=6,
            steps=((r.QUOTA_ALERT_RATIO, "red"),),
        ),
        g.timeseries(
            "GPUs allocated by GPU type",
            "GPUs held by bound pods, per GPU type, over the selected tenants.",
            g.target(f"sum by ({c.LABEL_GPU_TYPE}) ({r.TENANT_GPUS_ALLOCATED}{TEN})", "{{gpu_type}}"),
            width=12,
            decimals=0,
        ),
        g.timeseries(
            "GPUs free under quota by GPU type",
            "Quota less allocation per GPU type, over the selected tenants (negative: over quota).",
            g.target(f"sum by ({c.LABEL_GPU_TYPE}) ({headroom})", "{{gpu_type}}"),
            width=12,
            decimals=0,
        ),
        g.table(
            "GPUs by tenant and GPU type",
            "Allocated, quota and free (quota less allocated) per tenant and GPU type.",
            {
                "Allocated": g.target(f"{r.TENANT_GPUS_ALLOCATED}{TEN}"),
                "Quota": g.target(f"{r.TENANT_GPU_QUOTA}{TEN}"),
                "Free": g.target(headroom),
            },
            labels=(TENANT, c.LABEL_GPU_TYPE),
            width=12,
            decimals=0,
        ),
        g.timeseries(
            "Idle GPU share by tenant",
            f"Per tenant: share of its GPUs (averaged over {r.COST_WINDOW}) held by services that served no "
            f"token in {r.COST_WINDOW} ({r.TENANT_IDLE_GPU_RATIO}).",
            g.target(f"{r.TENANT_IDLE_GPU_RATIO}{TEN}", "{{tenant}}"),
            unit="percentunit",
            min_=0,
            max_=1,
            width=12,
        ),
    )
    states = ("ready", "not ready", "scaled to zero")
    services = g.row(
        "Services",
        g.stat(
            "Services by state",
            "InferenceServices in the selected namespaces: Ready and wanting replicas, not Ready while "
            "wanting replicas, and scaled to zero.",
            *(g.target(_services_in(s), s) for s in states),
            width=8,
            height=8,
            decimals=0,
        ),
        g.timeseries(
            "Services by state over time",
            "The same three counts over time.",
            *(g.target(_services_in(s), s) for s in states),
            width=8,
            decimals=0,
        ),
        g.stat(
            "Engine targets down",
            f"Scrape targets that exported engine series in the last {r.ENGINE_SEEN_WINDOW} and are down "
            f"({r.ALERT_ENGINE_DOWN} fires after 5 minutes).",
            g.target(
                f"count(up == 0 and on (job, instance) "
                f"last_over_time({c.NUM_REQUESTS_RUNNING}{_SVC_NS}[{r.ENGINE_SEEN_WINDOW}])) or vector(0)",
                "down",
            ),
            width=8,
            height=8,
            decimals=0,
            steps=((1, "red"),),
        ),
        g.table(
            "Services",
            "Each InferenceService in the selected namespaces: Ready (1 or 0), replicas desired and ready, "
            f"and its TTFT p95 over {r.RATE_WINDOW}.",
            {
                "Ready": g.target(f"{r.SERVICE_READY}{_SVC_NS}"),
                "Desired": g.target(f"{r.SERVICE_REPLICAS_DESIRED}{_SVC_NS}"),
                "Ready replicas": g.target(f"{r.SERVICE_REPLICAS_READY}{_SVC_NS}"),
                "TTFT p95 (s)": g.target(f"{r.SERVICE_TTFT_P95}{_SVC_NS}"),
            },
            labels=(NAMESPACE, SERVICE),
            width=24,
        ),
    )
    operator = g.row(
        "Operator",
        g.stat(
            "Operators scraped",
            f"Operator targets exporting reconcile counters (the {r.ALERT_OPERATOR_DOWN} alert fires at 0).",
            g.target(f"count(count by (job, instance) ({_OPERATOR})) or vector(0)", "operators"),
            width=6,
            height=8,
            decimals=0,
            steps=((0, "red"), (1, "green")),
        ),
        g.timeseries(
            "Reconcile rate",
            "Reconciles started per second, by what started them (spec, child, nodes-changed, "
            "tenant-changed, quota-freed).",
            g.target(
                f"sum by ({c.LABEL_TRIGGER}) ({rate(_OPERATOR, '')})",
                f"{{{{{c.LABEL_TRIGGER}}}}}",
            ),
            unit="ops",
            width=6,
        ),
        g.timeseries(
            "Reconcile errors",
            f"Reconciles that raised per second over {r.RATE_WINDOW}, by trigger (kopf retries them; "
            f"{r.ALERT_RECONCILE_ERRORS} fires after 15 minutes).",
            g.target(r.RECONCILE_ERRORS, f"{{{{{c.LABEL_TRIGGER}}}}}"),
            unit="ops",
            width=6,
        ),
        g.timeseries(
            "Reconcile latency",
            "Time to reconcile one InferenceService (plan, apply, status): p50 and p99.",
            g.target(
                f"histogram_quantile(0.5, sum by ({c.LABEL_LE}) "
                f"({rate(c.RECONCILE_DURATION + '_bucket', '')}))",
                "p50",
            ),
            g.target(r.RECONCILE_P99, "p99"),
            unit="s",
            width=6,
        ),
        g.timeseries(
            "Kubernetes API calls",
            "API calls the operator's own code made per second, by verb and resource (kopf's watches not "
            "included).",
            g.target(
                f"sum by (verb, resource) ({rate(c.counter_total(c.OPERATOR_API_CALLS), '')})",
                "{{verb}} {{resource}}",
            ),
            unit="ops",
            width=12,
        ),
        g.timeseries(
            "Webhook denials",
            "Objects the admission webhook refused per second, by reason (all tenants selected).",
            g.target(
                f"sum by ({c.LABEL_REASON}) ({r.ADMISSION_DENIALS}{TEN})",
                f"{{{{{c.LABEL_REASON}}}}}",
            ),
            unit="ops",
            width=12,
        ),
    )
    return g.dashboard(
        FLEET_UID,
        "Flotilla / Fleet",
        "The whole fleet: GPUs allocated and free under quota by GPU type and tenant, the idle GPU share, "
        "services by state, and the operator's health (reconciles, errors, latency, API calls, webhook "
        "refusals). No series counts GPUs per node, so none is shown by node.",
        variables,
        [gpus, services, operator],
        tags=["fleet"],
    )
