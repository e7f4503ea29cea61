"""The operator's Prometheus metrics and its /metrics + /healthz HTTP endpoint."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest

from flotilla.contract import METRICS_PATH

RECONCILE_DURATION = Histogram(
    "flotilla_reconcile_duration_seconds",
    "Time to reconcile one InferenceService (plan, apply, status)",
    ["trigger"],
)
RECONCILE_ERRORS = Counter(
    "flotilla_reconcile_errors",
    "Reconciles that raised (kopf retries them)",
    ["trigger"],
)
RECONCILES = Counter("flotilla_reconciles", "Reconciles started", ["trigger"])
API_CALLS = Counter(
    "flotilla_operator_api_calls",
    "Kubernetes API calls the operator's own code made (kopf's watches and annotations not included)",
    ["verb", "resource"],
)

# What started a reconcile. Declared up front so every series exists (at zero) from the first scrape.
TRIGGERS = ("spec", "child", "nodes-changed", "tenant-changed", "quota-freed")
for _trigger in TRIGGERS:
    RECONCILE_DURATION.labels(_trigger)
    RECONCILE_ERRORS.labels(_trigger)
    RECONCILES.labels(_trigger)


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
