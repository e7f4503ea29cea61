"""The Fleet dashboard: GPUs allocated and free under quota by GPU type and tenant, the idle GPU share,
services by state, the gateway (the picker's series: requests by status, rate limits, routing and
predicted prefix hits, held requests, its own latency, retries; and Envoy's: requests by status class and in
flight, retries to the engines, the picker's streams, the engines Envoy knows) and the operator's health
(reconciles, errors, latency, API calls, webhook refusals)."""

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
        "services by state, the gateway and its Envoy, and the operator's health (reconciles, errors, latency, "
        "API calls, webhook refusals). No series counts GPUs per node, so none is shown by node.",
        variables,
        [gpus, services, _gateway_row(), operator],
        tags=["fleet"],
    )


def _quantile(q: float, histogram: str, by: str = "") -> str:
    grouping = f"{c.LABEL_LE}, {by}" if by else c.LABEL_LE
    return f"histogram_quantile({q}, sum by ({grouping}) ({rate(histogram + '_bucket', '')}))"


# Envoy's series of the clients' listener (not the stats listener Prometheus itself reads), and of the
# engines' cluster.
_CLIENTS = f'{{{c.LABEL_ENVOY_PREFIX}="{c.ENVOY_CLIENTS_PREFIX}"}}'
_ENGINES = f'{{{c.LABEL_ENVOY_CLUSTER}="{c.ENVOY_ENGINES_CLUSTER}"}}'


def _gateway_row():
    """The gateway's (and its picker's) series, then Envoy's own: every gateway replica summed."""
    requests = c.counter_total(c.GATEWAY_REQUESTS)
    hits, prompts = c.counter_total(c.GATEWAY_PREDICTED_HIT_TOKENS), c.counter_total(c.GATEWAY_PROMPT_TOKENS)
    return g.row(
        "Gateway",
        g.timeseries(
            "Gateway requests by status",
            "Requests the gateway answered per second for the selected tenants (through Envoy and the "
            "picker, or the relay), by HTTP status (401: no or bad key; 403: another tenant's model; 429: a "
            "rate limit, a full hold queue or quota; 503: no replica became ready).",
            g.target(f"sum by ({c.LABEL_CODE}) ({rate(requests, TEN)})", f"{{{{{c.LABEL_CODE}}}}}"),
            unit="reqps",
            width=8,
        ),
        g.timeseries(
            "Rate-limited requests",
            "Requests refused by their tenant's rate limit per second, by tenant and limit (requests or tokens "
            "per Tenant.spec.rateLimits).",
            g.target(
                f"sum by ({c.LABEL_TENANT}, {c.LABEL_LIMIT}) ({rate(c.counter_total(c.GATEWAY_RATE_LIMITED), TEN)})",
                f"{{{{{c.LABEL_TENANT}}}}} {{{{{c.LABEL_LIMIT}}}}}",
            ),
            unit="reqps",
            width=8,
        ),
        g.timeseries(
            "Routing",
            "Routing decisions per second by reason, and the predicted prefix-hit share: prompt tokens the "
            "chosen replica was predicted to hold in its prefix cache, over all prompt tokens routed.",
            g.target(
                f"sum by ({c.LABEL_REASON}) ({rate(c.counter_total(c.GATEWAY_ROUTING_DECISIONS), '')})",
                f"{{{{{c.LABEL_REASON}}}}}",
            ),
            g.target(f"sum({rate(hits, '')}) / (sum({rate(prompts, '')}) > 0)", "predicted hit share"),
            width=8,
        ),
        g.timeseries(
            "Held for a replica",
            "Requests the gateway holds for a service with no ready replica (scale from zero), by model.",
            g.target(f"sum by ({c.LABEL_MODEL}) ({c.GATEWAY_HELD_REQUESTS})", f"{{{{{c.LABEL_MODEL}}}}}"),
            width=8,
        ),
        g.timeseries(
            "Gateway latency",
            "What the gateway adds (arrival to the pick: keys, limits, tokenizing, routing), p50 and p99; and "
            "the engine's time to first byte, p95 (through Envoy: the pick to the response's headers).",
            g.target(_quantile(0.5, c.GATEWAY_ADDED_LATENCY), "added p50"),
            g.target(_quantile(0.99, c.GATEWAY_ADDED_LATENCY), "added p99"),
            g.target(_quantile(0.95, c.GATEWAY_UPSTREAM_TTFB), "upstream TTFB p95"),
            unit="s",
            width=8,
        ),
        g.timeseries(
            "Retries before the first byte",
            "Requests sent again to another replica per second (an engine that refused, reset or answered "
            "503 before its response): the gateway's count by model (the relay's retries, and Envoy's to the "
            "pick's fallback, which the picker reads from Envoy's attempt count), and Envoy's own count of "
            "its retries to the engines, every model together.",
            g.target(
                f"sum by ({c.LABEL_MODEL}) ({rate(c.counter_total(c.GATEWAY_RETRIES), '')})",
                f"{{{{{c.LABEL_MODEL}}}}}",
            ),
            g.target(f"sum({rate(c.ENVOY_UPSTREAM_RQ_RETRY, _ENGINES)})", "Envoy, all models"),
            unit="reqps",
            width=8,
        ),
        g.timeseries(
            "Envoy requests by status class",
            "Requests Envoy answered its clients per second, by status class (2xx, 4xx, 5xx: the picker's "
            "refusals included; a 503 without the picker is Envoy's own, FailClose), and all requests "
            "received.",
            g.target(
                f"sum by ({c.LABEL_ENVOY_CODE_CLASS}) ({rate(c.ENVOY_DOWNSTREAM_RQ_XX, _CLIENTS)})",
                f"{{{{{c.LABEL_ENVOY_CODE_CLASS}}}}}xx",
            ),
            g.target(f"sum({rate(c.ENVOY_DOWNSTREAM_RQ, _CLIENTS)})", "received"),
            unit="reqps",
            width=8,
        ),
        g.timeseries(
            "Envoy requests in flight",
            "Client requests Envoy carries now, every gateway replica summed (held ones included: they wait "
            "in Envoy for the picker's answer).",
            g.target(f"sum({c.ENVOY_DOWNSTREAM_RQ_ACTIVE}{_CLIENTS})", "in flight"),
            width=8,
            decimals=0,
        ),
        g.timeseries(
            "Envoy, the picker and the engines",
            "Per second: ext_proc streams to the picker that failed, and picker answers Envoy timed out "
            "waiting for; connections to engines that failed. And the engines Envoy knows from the picker "
            "(EDS), at most over the gateway replicas.",
            g.target(f"sum({rate(c.ENVOY_EXT_PROC_STREAMS_FAILED, _CLIENTS)})", "picker streams failed"),
            g.target(f"sum({rate(c.ENVOY_EXT_PROC_MESSAGE_TIMEOUTS, _CLIENTS)})", "picker timeouts"),
            g.target(f"sum({rate(c.ENVOY_UPSTREAM_CX_CONNECT_FAIL, _ENGINES)})", "engine connect failures"),
            g.target(f"max({c.ENVOY_MEMBERSHIP_TOTAL}{_ENGINES})", "engines known"),
            width=8,
        ),
    )
