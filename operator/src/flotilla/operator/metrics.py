"""The operator's Prometheus metrics and its /metrics + /healthz HTTP endpoint.

Names come from flotilla.contract (the monitoring rules read them there too). Labels stay bounded:
triggers and reasons are fixed sets; namespaces, services and tenants are the cluster's objects.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.utils import floatToGoString

from flotilla import contract
from flotilla.contract import (
    ADMISSION_DENIALS,
    LABEL_LE,
    LABEL_NAMESPACE,
    LABEL_REASON,
    LABEL_SERVICE,
    LABEL_TENANT,
    LABEL_TRIGGER,
    LATENCY_BUCKETS,
    METRICS_PATH,
    OPERATOR_API_CALLS,
    SERVICE_DESIRED_REPLICAS,
    SERVICE_READY,
    SERVICE_READY_REPLICAS,
    SERVICE_TTFT_TARGET,
)

RECONCILE_DURATION = Histogram(
    contract.RECONCILE_DURATION,
    "Time to reconcile one InferenceService (plan, apply, status)",
    [LABEL_TRIGGER],
)
RECONCILE_ERRORS = Counter(
    contract.RECONCILE_ERRORS,
    "Reconciles that raised (kopf retries them)",
    [LABEL_TRIGGER],
)
RECONCILES = Counter(contract.RECONCILES, "Reconciles started", [LABEL_TRIGGER])
API_CALLS = Counter(
    OPERATOR_API_CALLS,
    "Kubernetes API calls the operator's own code made (kopf's watches and annotations not included)",
    ["verb", "resource"],
)
# `tenant` is the Tenant the refused object would be charged to ("" when none), or the refused Tenant.
DENIALS = Counter(
    ADMISSION_DENIALS,
    "Objects the admission webhook refused, by the refusal's reason",
    [LABEL_TENANT, LABEL_REASON],
)
# A refused Tenant's reasons (an InferenceService's come from its verdict).
INVALID_TENANT = "InvalidTenant"  # the spec does not parse
TENANT_CONFLICT = "TenantConflict"  # a namespace another Tenant claims, a price outside the quota

# What started a reconcile. Declared up front so every series exists (at zero) from the first scrape.
TRIGGERS = ("spec", "child", "nodes-changed", "tenant-changed", "quota-freed", "picker-changed")
for _trigger in TRIGGERS:
    RECONCILE_DURATION.labels(_trigger)
    RECONCILE_ERRORS.labels(_trigger)
    RECONCILES.labels(_trigger)


def slo_bucket(target_seconds: float) -> str | None:
    """The `le` label of the largest engine latency bucket at or below a TTFT target, spelled as the
    engine's exposition spells it (prometheus_client's floatToGoString: 0.5 -> "0.5", 1 -> "1.0"); None
    when the target is below every bucket. The share of requests in that bucket is the share that met the
    target, rounded down to the bucket boundary (monitoring's SLO rule reads it)."""
    below = [b for b in LATENCY_BUCKETS if b <= target_seconds]
    return floatToGoString(below[-1]) if below else None


@dataclass(frozen=True)
class ServiceFigures:
    """What the service series say about one InferenceService."""

    ready: bool
    desired_replicas: int
    ready_replicas: int
    ttft_target_seconds: float | None  # spec.autoscaling.ttftP95TargetSeconds


class ServiceCollector:
    """Per-service series from what the reconciler last wrote. A collector rather than gauges, so a
    changed TTFT target (a new `le`) or a deleted service leaves no stale series behind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._services: dict[tuple[str, str], ServiceFigures] = {}

    def update(self, namespace: str, name: str, figures: ServiceFigures) -> None:
        with self._lock:
            self._services[(namespace, name)] = figures

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._services.pop((namespace, name), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            services = sorted(self._services.items())
        labels = [LABEL_NAMESPACE, LABEL_SERVICE]
        ready = GaugeMetricFamily(SERVICE_READY, "1 when the Ready condition is True, else 0", labels=labels)
        desired = GaugeMetricFamily(
            SERVICE_DESIRED_REPLICAS, "Replicas the operator asks the Deployment for", labels=labels
        )
        ready_replicas = GaugeMetricFamily(SERVICE_READY_REPLICAS, "Ready engine pods", labels=labels)
        target = GaugeMetricFamily(
            SERVICE_TTFT_TARGET,
            "spec.autoscaling.ttftP95TargetSeconds; `le` is the largest engine TTFT bucket at or below it",
            labels=[*labels, LABEL_LE],
        )
        for (namespace, name), f in services:
            ready.add_metric([namespace, name], 1.0 if f.ready else 0.0)
            desired.add_metric([namespace, name], f.desired_replicas)
            ready_replicas.add_metric([namespace, name], f.ready_replicas)
            if f.ttft_target_seconds is not None:
                # No bucket at or below the target: the label is left out (no SLO series for it).
                target.add_metric(
                    [namespace, name, slo_bucket(f.ttft_target_seconds) or ""], f.ttft_target_seconds
                )
        yield from (ready, desired, ready_replicas, target)


SERVICES = ServiceCollector()
REGISTRY.register(SERVICES)


class Health:
    """Healthy once kopf has started and until it stops."""

    def __init__(self) -> None:
        self._ok = threading.Event()

    def set(self, ok: bool) -> None:
        if ok:
            self._ok.set()
        else:
            self._ok.clear()

    @property
    def ok(self) -> bool:
        return self._ok.is_set()


HEALTH = Health()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        path = self.path.split("?", 1)[0]
        if path == METRICS_PATH:
            self._send(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            ok = HEALTH.ok
            self._send(200 if ok else 503, b"ok\n" if ok else b"starting\n", "text/plain")
        else:
            self._send(404, b"not found\n", "text/plain")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args) -> None:  # scrapes are not worth a log line each
        pass


def serve(host: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), _Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
