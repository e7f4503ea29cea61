"""The Prometheus metrics source against a real Prometheus server (Debian's `prometheus` package) that
scrapes two engine exporters (the engine's own metrics code, fed by hand) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client import generate_latest

from flotilla.cluster.handle import free_port
from flotilla.cluster.prometheus import BINARY as prometheus_binary
from flotilla.cluster.prometheus import PrometheusProcess
from flotilla.engine.core.outputs import EngineStats
from flotilla.engine.server.metrics import EngineMetrics
from flotilla.operator.api.v1alpha1 import Autoscaling
from flotilla.operator.autoscaling.autoscaler import ServiceAutoscaler
from flotilla.operator.clients import prometheus as prometheus_source
from flotilla.operator.clients.engine_metrics import PodScraper, parse_engine_metrics
from flotilla.operator.desired.status import PodView

pytestmark = pytest.mark.skipif(
    prometheus_binary is None, reason="needs the prometheus binary (apt install prometheus)"
)


class Exporter:
    """An engine's /metrics on a loopback port."""

    def __init__(self) -> None:
        self.stats = EngineStats()
        self.metrics = EngineMetrics("tiny", lambda: self.stats)
        registry = self.metrics.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def text(self) -> str:
        return generate_latest(self.metrics.registry).decode()


@pytest.fixture
def engines(monkeypatch):
    monkeypatch.setenv("FLOTILLA_SERVICE", "chat")  # what the operator sets on engine pods
    pods = {"chat-0": Exporter(), "chat-1": Exporter()}
    yield pods
    for e in pods.values():
        e.server.shutdown()
        e.server.server_close()


@pytest.fixture
def prometheus(engines, tmp_path):
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "engines",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{e.port}"], "labels": {"namespace": "team-a", "pod": name}}
                    for name, e in engines.items()
                ],
            }
        ],
    }
    with PrometheusProcess(config, tmp_path / "prometheus") as prom:
        yield prom.url


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as rsp:
            return rsp.status
    except OSError:
        return 0


def _wait(predicate, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _collect(url: str, ready: set[str], window: int = 30):
    async def go():
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            return await prometheus_source.collect(client, url, "team-a", "chat", window, ready)

    return asyncio.run(go())


def _targets_up(url: str) -> bool:
    signals = _collect(url, {"chat-0", "chat-1"})
    return len(signals.waiting) == 2


def test_queries_select_the_service_and_window():
    q = prometheus_source.queries("team-a", "chat", 45)
    assert q["waiting"] == 'sum by (pod) (flotilla_num_requests_waiting{namespace="team-a",service="chat"})'
    assert "[45s]" in q["ttft_p95"] and q["ttft_p95"].startswith("histogram_quantile(0.95,")
    assert q["running"] == 'sum by (pod) (flotilla_num_requests_running{namespace="team-a",service="chat"})'
    assert q["tokens"] == (
        'sum by (pod) ({__name__=~"flotilla_prompt_tokens_total|flotilla_generation_tokens_total",'
        'namespace="team-a",service="chat"})'
    )


def test_prometheus_mode_reads_the_same_signals_as_scraping(engines, prometheus):
    _wait(lambda: _targets_up(prometheus), "Prometheus to scrape both engines")
    scraper = PodScraper(30)
    scraper.signals(0, {n: parse_engine_metrics(e.text()) for n, e in engines.items()}, set(engines))

    engines["chat-0"].stats.num_waiting = 5
    engines["chat-1"].stats.num_waiting = 1
    engines["chat-0"].stats.num_running = 3
    engines["chat-1"].stats.prompt_tokens, engines["chat-1"].stats.generation_tokens = 30, 12
    for _ in range(20):
        engines["chat-0"].metrics.ttft.observe(1.2)
    for _ in range(20):
        engines["chat-1"].metrics.ttft.observe(0.02)
    direct = scraper.signals(5, {n: parse_engine_metrics(e.text()) for n, e in engines.items()}, set(engines))

    def fresh():
        s = _collect(prometheus, {"chat-0", "chat-1"})
        seen = s.waiting == {"chat-0": 5, "chat-1": 1} and s.tokens.get("chat-1") == 42
        return s if seen and s.ttft_p95 is not None else None

    via_prometheus = _wait(fresh, "Prometheus to see the new values")
    # The same bucket, interpolated the same way; rate()'s per-series extrapolation shifts it slightly.
    assert direct.ttft_p95 == pytest.approx(1.45)
    assert 1.0 < via_prometheus.ttft_p95 <= 1.5
    assert via_prometheus.ttft_p95 == pytest.approx(direct.ttft_p95, rel=0.05)
    assert via_prometheus.kv_usage == 0 and via_prometheus.errors == {}
    # The idle rule's figures (scale to zero) read the same either way.
    assert via_prometheus.running == direct.running == {"chat-0": 3, "chat-1": 0}
    assert via_prometheus.tokens == direct.tokens == {"chat-0": 0, "chat-1": 42}


def test_a_pod_prometheus_does_not_know_counts_as_silent(engines, prometheus):
    _wait(lambda: _targets_up(prometheus), "Prometheus to scrape both engines")
    signals = _collect(prometheus, {"chat-0", "chat-1", "chat-new"})
    assert set(signals.waiting) == {"chat-0", "chat-1"}
    assert "no flotilla_num_requests_waiting series" in signals.errors["chat-new"]


def test_prometheus_down_holds_the_replicas():
    closed = f"http://127.0.0.1:{free_port()}"
    signals = _collect(closed, {"chat-0", "chat-1"})
    assert signals.waiting == {} and "Prometheus at" in signals.errors["chat-0"]
    spec = Autoscaling.model_validate({"minReplicas": 1, "maxReplicas": 4, "queueDepthTarget": 2})
    pods = [PodView(n, "127.0.0.9", True, 0, None) for n in ("chat-0", "chat-1")]
    step = ServiceAutoscaler().step(now=0, spec=spec, current=2, pods=pods, signals=signals, quota=None)
    assert (step.outcome.desired, step.outcome.reason) == (2, "NoMetrics")
    assert not math.isnan(step.metrics.pods_unanswered) and step.metrics.pods_unanswered == 2
