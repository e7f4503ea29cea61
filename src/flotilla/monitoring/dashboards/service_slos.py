"""The Service SLOs dashboard, per InferenceService: traffic, latency percentiles and TTFT SLO
attainment, queue, KV cache, prefix cache, preemptions, replicas and the autoscaler's decisions.

`tenant` and `model` narrow the namespaces and services listed, whose "All" then means the services
listed."""

from __future__ import annotations

from flotilla import contract as c
from flotilla.monitoring import grafana as g
from flotilla.monitoring.dashboards.common import (
    BY_SERVICE,
    MODEL,
    NAMESPACE,
    NS_SVC,
    SERVICE,
    SVC,
    TENANT,
    increase,
    rate,
    sel,
)
from flotilla.monitoring.rules import names as r

SERVICE_UID = "flotilla-service-slos"
_ENGINE = sel(TENANT, NAMESPACE, MODEL, SERVICE)  # the engines' own series


def _latency(what: str, p50: str, p95: str, p99: str, extra: tuple[dict, ...] = ()) -> dict:
    return g.timeseries(
        f"{what} p50 / p95 / p99",
        f"{what} percentiles per service over {r.RATE_WINDOW} (recording rules {p50}, {p95}, {p99}); no "
        "line while a service has no requests.",
        g.target(f"{p50}{SVC}", f"p50 {NS_SVC}"),
        g.target(f"{p95}{SVC}", f"p95 {NS_SVC}"),
        g.target(f"{p99}{SVC}", f"p99 {NS_SVC}"),
        *extra,
        unit="s",
        width=8,
    )


def dashboard() -> dict:
    chain = c.NUM_REQUESTS_RUNNING  # every engine pod exports it, with all four labels
    variables = [
        g.variable(TENANT, "Tenant", chain),
        g.variable(NAMESPACE, "Namespace", chain, sel(TENANT), all_value=None),
        g.variable(MODEL, "Model", chain, sel(TENANT, NAMESPACE)),
        g.variable(SERVICE, "Service", chain, sel(TENANT, NAMESPACE, MODEL), all_value=None),
    ]
    traffic = g.row(
        "Traffic",
        g.timeseries(
            "Request rate",
            f"Finished requests per second per service over {r.RATE_WINDOW}, all finish reasons "
            f"({r.SERVICE_REQUESTS}).",
            g.target(f"{r.SERVICE_REQUESTS}{SVC}", NS_SVC),
            unit="reqps",
            width=8,
        ),
        g.timeseries(
            "Finished requests by reason",
            "Requests finished per second by finish reason: stop (a stop token or string), length "
            "(max_tokens or the context), abort (the client went away or the engine drained).",
            g.target(
                f"sum by ({BY_SERVICE}, {c.LABEL_FINISH_REASON}) "
                f"({rate(c.counter_total(c.REQUEST_SUCCESS), _ENGINE)})",
                f"{NS_SVC} {{{{{c.LABEL_FINISH_REASON}}}}}",
            ),
            unit="reqps",
            width=8,
        ),
        g.timeseries(
            "Tokens per second",
            f"Prompt tokens processed and tokens generated per second per service over {r.RATE_WINDOW}.",
            g.target(f"{r.SERVICE_INPUT_TOKENS}{SVC}", f"in {NS_SVC}"),
            g.target(f"{r.SERVICE_OUTPUT_TOKENS}{SVC}", f"out {NS_SVC}"),
            width=8,
        ),
    )
    latency = g.row(
        "Latency and SLO",
        _latency(
            "Time to first token",
            r.SERVICE_TTFT_P50,
            r.SERVICE_TTFT_P95,
            r.SERVICE_TTFT_P99,
            (g.target(f"{r.SERVICE_TTFT_TARGET}{SVC}", f"target {NS_SVC}"),),
        ),
        _latency("Inter-token latency", r.SERVICE_ITL_P50, r.SERVICE_ITL_P95, r.SERVICE_ITL_P99),
        _latency("End-to-end latency", r.SERVICE_E2E_P50, r.SERVICE_E2E_P95, r.SERVICE_E2E_P99),
        g.timeseries(
            "TTFT SLO attainment",
            "Share of requests whose time to first token met the service's own ttftP95TargetSeconds, over "
            f"{r.RATE_WINDOW}; measured at the largest histogram bucket at or below the target, so it is "
            "never overstated. Only services that set a target have a line.",
            g.target(f"{r.SERVICE_TTFT_SLO}{SVC}", NS_SVC),
            unit="percentunit",
            min_=0,
            max_=1,
            width=16,
        ),
        g.stat(
            "TTFT SLO attainment now",
            f"The lowest TTFT SLO attainment of the selected services over the last {r.RATE_WINDOW}.",
            g.target(f"min({r.SERVICE_TTFT_SLO}{SVC})", "lowest"),
            unit="percentunit",
            width=8,
            height=8,
        ),
    )
    load = g.row(
        "Engine load",
        g.timeseries(
            "Queue",
            "Requests waiting to be scheduled and requests running, summed over each service's pods.",
            g.target(f"{r.SERVICE_QUEUE_DEPTH}{SVC}", f"waiting {NS_SVC}"),
            g.target(f"{r.SERVICE_RUNNING}{SVC}", f"running {NS_SVC}"),
            width=6,
        ),
        g.timeseries(
            "KV-cache usage",
            "Share of KV-cache blocks in use on each service's fullest pod: near 1, new requests wait and "
            "running ones may be preempted.",
            g.target(f"{r.SERVICE_KV_CACHE_USAGE}{SVC}", NS_SVC),
            unit="percentunit",
            min_=0,
            max_=1,
            width=6,
        ),
        g.timeseries(
            "Prefix-cache hit rate",
            f"Prompt tokens found in the prefix cache / prompt tokens looked up, over {r.RATE_WINDOW}; no "
            "line without lookups.",
            g.target(f"{r.SERVICE_PREFIX_CACHE_HIT}{SVC}", NS_SVC),
            unit="percentunit",
            min_=0,
            max_=1,
            width=6,
        ),
        g.timeseries(
            "Preemptions",
            "Sequences preempted per second (their KV blocks freed to make room; they are recomputed "
            "later): a sign the KV cache is too small for the load.",
            g.target(f"sum by ({BY_SERVICE}) ({rate(c.counter_total(c.NUM_PREEMPTIONS), _ENGINE)})", NS_SVC),
            unit="ops",
            width=6,
        ),
    )
    scaling = g.row(
        "Replicas and autoscaling",
        g.timeseries(
            "Replicas desired and ready",
            "Replicas the operator asks the Deployment for, and engine pods that are ready.",
            g.target(f"{r.SERVICE_REPLICAS_DESIRED}{SVC}", f"desired {NS_SVC}"),
            g.target(f"{r.SERVICE_REPLICAS_READY}{SVC}", f"ready {NS_SVC}"),
            width=8,
            decimals=0,
        ),
        g.timeseries(
            "Autoscaler decision",
            "Replicas the autoscaler decided on at its last decision (before quota and the Deployment), "
            "per service that autoscales.",
            g.target(f"max by ({BY_SERVICE}) ({c.AUTOSCALER_DESIRED_REPLICAS}{SVC})", NS_SVC),
            width=8,
            decimals=0,
        ),
        g.timeseries(
            "Autoscaler scale changes",
            "Scale-ups and scale-downs the autoscaler made, per rate interval.",
            g.target(
                f"sum by ({BY_SERVICE}, {c.LABEL_DIRECTION}) "
                f"({increase(c.counter_total(c.AUTOSCALER_SCALES), SVC, '$__rate_interval')})",
                f"{{{{{c.LABEL_DIRECTION}}}}} {NS_SVC}",
            ),
            width=8,
            decimals=0,
            bars=True,
        ),
        g.timeseries(
            "Autoscaler signal: TTFT p95",
            "The TTFT p95 the autoscaler read over the service's TTFT window, against the service's target.",
            g.target(f"max by ({BY_SERVICE}) ({c.AUTOSCALER_TTFT_P95}{SVC})", f"p95 {NS_SVC}"),
            g.target(f"{r.SERVICE_TTFT_TARGET}{SVC}", f"target {NS_SVC}"),
            unit="s",
            width=6,
        ),
        g.timeseries(
            "Autoscaler signal: queue per replica",
            "Waiting requests per ready replica, as the autoscaler read them.",
            g.target(f"max by ({BY_SERVICE}) ({c.AUTOSCALER_QUEUE_DEPTH}{SVC})", NS_SVC),
            width=6,
        ),
        g.timeseries(
            "Autoscaler signal: KV-cache usage",
            "The highest KV-cache usage of the ready pods, as the autoscaler read it.",
            g.target(f"max by ({BY_SERVICE}) ({c.AUTOSCALER_KV_CACHE_USAGE}{SVC})", NS_SVC),
            unit="percentunit",
            min_=0,
            max_=1,
            width=6,
        ),
        g.timeseries(
            "Autoscaler scrape failures",
            "Engine /metrics scrapes the autoscaler could not make, per second: it decides on the pods it "
            "could read.",
            g.target(
                f"sum by ({BY_SERVICE}) ({rate(c.counter_total(c.AUTOSCALER_SCRAPE_FAILURES), SVC)})",
                NS_SVC,
            ),
            unit="ops",
            width=6,
        ),
    )
    return g.dashboard(
        SERVICE_UID,
        "Flotilla / Service SLOs",
        "Per InferenceService: traffic, latency percentiles and TTFT SLO attainment, queue, KV cache, prefix "
        "cache, preemptions, replicas and the autoscaler's decisions. Tenant and Model narrow the services "
        "listed.",
        variables,
        [traffic, latency, load, scaling],
        tags=["slo"],
    )
