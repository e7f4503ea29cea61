"""The autoscaler's kopf layer: one async daemon per InferenceService that has spec.autoscaling.

Each period it reads the service's signals (scraping its ready pods, or asking Prometheus when
--prometheus-url is set), asks the tenant's quota how far the service may grow,
runs the pure rule (autoscaling/rule.py via autoscaler.ServiceAutoscaler), and carries out the result:
a PATCH of the InferenceService's scale subresource (the reconciler then resizes the Deployment, so quota
and status stay in one place), status.autoscaling, an Event for every scale, and the gauges.

Scale from zero: the gateway stamps the demand annotation (flotilla.contract.ANNOTATION_DEMAND) on a
service it holds a request for. `demand_arrived` below reacts to that field's change by waking the service's
daemon, which decides at once instead of at the end of its period: a fresh demand at zero replicas scales
to one through the scale subresource like any scale-up, so the reconciler's quota check admits it or holds
it back with the reason in the InferenceService's QuotaAdmitted and Degraded conditions.

kopf puts its finalizer on every object a daemon runs for (so it can stop the daemon first): deleting an
autoscaled service waits for a running operator. kopf also stops daemons while peering pauses this
operator, so a standby replica never scales.
"""

from __future__ import annotations

import asyncio
import logging
import time

import kopf

from flotilla import timestamps
from flotilla.contract import ANNOTATION_DEMAND
from flotilla.operator.api.v1alpha1 import GROUP, INFERENCE_SERVICE, VERSION, Autoscaling
from flotilla.operator.autoscaling import metrics as autoscale_metrics
from flotilla.operator.autoscaling.autoscaler import (
    METRICS_FALLBACK,
    QUOTA_LIMITED,
    ServiceAutoscaler,
    autoscaling_status,
    metrics_source,
    scraped_pods,
)
from flotilla.operator.autoscaling.scale_to_zero import demand_time, fresh_demand
from flotilla.operator.clients import prometheus as prometheus_source
from flotilla.operator.clients.engine_metrics import PodScraper
from flotilla.operator.controllers import failpoints
from flotilla.operator.controllers.indexes import ISVC, index_one, labels_by_namespace, tenant_specs
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.desired.status import pod_view
from flotilla.operator.metrics import API_CALLS
from flotilla.operator.tenancy.quota import Key, QuotaDecision, granted_replicas, used_gpus
from flotilla.operator.tenancy.rules import owner_of

log = logging.getLogger("flotilla.operator.autoscaling.autoscaler")

SCRAPE_TIMEOUT_SECONDS = 2.0


def _autoscaled(spec, **_) -> bool:
    return bool((spec or {}).get("autoscaling"))


def _quota(
    rt: Runtime, key: Key, spec: dict, indexes: dict, wanted: int, current: int
) -> QuotaDecision | None:
    """The tenancy rule (quota.granted_replicas) asked about `wanted` replicas, against the reconciler's ledger."""
    resources = spec.get("resources") or {}
    gpu_type, gpus = resources.get("gpuType"), resources.get("gpus", 1)
    specs = tenant_specs(indexes["tenants"])
    claim = owner_of(key[0], specs, labels_by_namespace(indexes["namespace_labels"]))
    tenant = claim.tenant
    others = rt.held.others(key)
    if tenant is None and not claim.contested:
        return None
    return granted_replicas(
        contest=claim.contest_message() if claim.contested else None,
        tenant=tenant,
        tenant_spec=specs.get(tenant) if tenant else None,
        gpu_type=gpu_type,
        gpus_per_replica=gpus,
        requested=wanted,
        current=current,
        used_by_others=used_gpus(others, tenant or "", gpu_type),
    )


def _patch_scale(rt: Runtime, namespace: str, name: str, replicas: int) -> None:
    API_CALLS.labels(verb="patch", resource="inferenceservices/scale").inc()
    rt.kube.custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, INFERENCE_SERVICE.plural, name, {"spec": {"replicas": replicas}}
    )


class _Daemon:
    """The state one service's daemon keeps between decisions."""

    def __init__(self, rt: Runtime, key: Key) -> None:
        self.rt = rt
        self.key = key
        self.scaler: ServiceAutoscaler | None = None
        self.scraper: PodScraper | None = None
        self.written: dict | None = None

    async def decide_once(self, client, indexes: dict) -> int:
        """One scrape-and-decide round; returns the seconds to wait before the next."""
        namespace, name = self.key
        obj = index_one(indexes["services"], self.key)
        if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
            return 5
        spec = obj.get("spec") or {}
        autoscaling = Autoscaling.model_validate(spec["autoscaling"])
        current = int(spec.get("replicas", 1))
        if self.scaler is None:
            self.scaler = ServiceAutoscaler()
            self.scraper = PodScraper(autoscaling.ttft_window_seconds)
            self.written = (obj.get("status") or {}).get("autoscaling")

        now = time.monotonic()
        pods = [pod_view(p) for p in indexes["pods"].get(self.key, [])]
        targets = scraped_pods(pods)
        window = autoscaling.ttft_window_seconds
        prometheus_url = self.rt.config.prometheus_url
        live = {p.name for p in pods if not p.deleting}
        fallback = None
        if prometheus_url:
            try:
                signals = await prometheus_source.query(
                    client, prometheus_url, namespace, name, window, set(targets)
                )
            except prometheus_source.Unavailable as exc:
                # Scaling on what the engines say beats holding still for the whole outage. The failed
                # reads still count: the operator's configured source is down, which an alert should see.
                fallback = str(exc)
                autoscale_metrics.SCRAPE_FAILURES.labels(namespace, name).inc(max(1, len(targets)))
                signals = await self.scraper.collect(client, now, window, targets, live)
        else:
            signals = await self.scraper.collect(client, now, window, targets, live)
        # At zero the question is one replica (a demand's); otherwise how far the service may grow.
        wanted = 1 if current == 0 else autoscaling.max_replicas
        quota = _quota(self.rt, self.key, spec, indexes, wanted, current)
        annotations = obj.get("metadata", {}).get("annotations") or {}
        demand = fresh_demand(
            demand_time(annotations.get(ANNOTATION_DEMAND)),
            time.time(),
            autoscaling.scale_to_zero_after_seconds,
        )
        step = self.scaler.step(
            now=now,
            spec=autoscaling,
            current=current,
            pods=pods,
            signals=signals,
            quota=quota,
            demand=demand,
        )
        outcome = step.outcome
        if step.errors:
            autoscale_metrics.SCRAPE_FAILURES.labels(namespace, name).inc(len(step.errors))
            log.info("%s/%s: scrapes failed: %s", namespace, name, "; ".join(step.errors.values()))

        scaled = outcome.desired != current
        if scaled:
            await asyncio.to_thread(_patch_scale, self.rt, namespace, name, outcome.desired)
            failpoints.reached("autoscaling.scaled")
            direction = "up" if outcome.desired > current else "down"
            autoscale_metrics.SCALES.labels(namespace, name, direction).inc()
            kopf.event(
                obj, type="Normal", reason=f"Scaled{direction.title()}", message=outcome.message[:1000]
            )
            log.info("%s/%s: scaled %s: %s", namespace, name, direction, outcome.message)

        was_quota_limited = any(
            c.get("type") == QUOTA_LIMITED and c.get("status") == "True"
            for c in (self.written or {}).get("conditions") or []
        )
        if outcome.quota_limited and not was_quota_limited:
            kopf.event(obj, type="Warning", reason=QUOTA_LIMITED, message=outcome.message[:1000])
        was_falling_back = any(
            c.get("type") == METRICS_FALLBACK and c.get("status") == "True"
            for c in (self.written or {}).get("conditions") or []
        )
        if fallback is not None and not was_falling_back:
            kopf.event(obj, type="Warning", reason="PrometheusUnavailable", message=fallback[:1000])
            log.warning("%s/%s: %s; scraping the engines instead", namespace, name, fallback)

        status = autoscaling_status(
            step,
            previous=self.written,
            now=timestamps.now(),
            generation=obj["metadata"].get("generation", 0),
            scaled=scaled,
            source=metrics_source(prometheus_url, fallback),
        )
        # Only status.autoscaling: the reconciler owns the rest of status (clients.kube.patch_service_status).
        await asyncio.to_thread(self.rt.kube.patch_service_status, namespace, name, {"autoscaling": status})
        self.written = status
        m = step.metrics
        autoscale_metrics.record(
            namespace,
            name,
            outcome.desired,
            m.ttft_p95_seconds,
            m.queue_depth_per_replica,
            m.kv_cache_usage_ratio,
        )
        return autoscaling.period_seconds


async def _pause(stopped: kopf.DaemonStopped, wake: asyncio.Event, seconds: float) -> None:
    """Until the next decision: `seconds`, or less when the daemon is stopped or woken."""

    async def until_stopped() -> None:
        await stopped.wait(seconds)

    waits = {asyncio.ensure_future(until_stopped()), asyncio.ensure_future(wake.wait())}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
    wake.clear()


@kopf.daemon(*ISVC, when=_autoscaled, cancellation_timeout=10)
async def autoscale(
    stopped: kopf.DaemonStopped, namespace: str, name: str, memo: kopf.Memo, **kwargs
) -> None:
    import httpx

    rt: Runtime = memo.runtime
    indexes = {k: kwargs[k] for k in ("services", "pods", "tenants", "namespace_labels")}
    daemon = _Daemon(rt, (namespace, name))
    wake = rt.autoscaler_wake.setdefault((namespace, name), asyncio.Event())
    try:
        # trust_env=False: pod traffic never goes through a proxy from the environment.
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_SECONDS, trust_env=False) as client:
            while not stopped:
                try:
                    wait = await daemon.decide_once(client, indexes)
                except Exception as exc:  # one failed round must not end autoscaling for good
                    log.warning("%s/%s: autoscaling round failed: %s", namespace, name, exc, exc_info=exc)
                    wait = 5
                await _pause(stopped, wake, wait)
    finally:
        if rt.autoscaler_wake.get((namespace, name)) is wake:
            del rt.autoscaler_wake[(namespace, name)]
        autoscale_metrics.forget(namespace, name)


@kopf.on.field(*ISVC, id="demand", field=("metadata", "annotations", ANNOTATION_DEMAND), when=_autoscaled)
async def demand_arrived(new, namespace: str, name: str, memo: kopf.Memo, **_) -> None:
    """The gateway holds a request for this service: its autoscaler decides now, not at its next period.
    kopf has updated the index from the same event before any handler runs, so the daemon reads the new
    stamp. A service without a running daemon (none yet, or a standby operator) decides when it starts."""
    if not new:
        return
    wake = memo.runtime.autoscaler_wake.get((namespace, name))
    if wake is not None:
        wake.set()
