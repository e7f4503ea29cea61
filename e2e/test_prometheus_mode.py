"""The autoscaler's Prometheus mode on the local cluster.

A real Prometheus (built from Go modules by `flotilla cluster build`) discovers the engine pods with
kubernetes_sd_configs through the API server, as a ServiceAccount allowed only to list and watch pods in
the test's namespace, and scrapes those annotated `prometheus.io/scrape` with the labels the usual
`kubernetes-pods` job gives, `namespace` and `pod` (flotilla.monitoring.scrape). The operator runs with
`--prometheus-url` and reads TTFT p95 and queue depth from it with PromQL. The TTFT target is set far
below what any request takes, so a little traffic must scale the service from 1 to 2, and only data read
from Prometheus can make it do so.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle, wait_for
from flotilla.cluster.prometheus import PrometheusProcess
from flotilla.monitoring.scrape import ApiAccess, prometheus_config
from flotilla.operator.cmd.local import (
    OperatorProcess,
    complete,
    inference_service,
    install_manifests,
    service_account_kubeconfig,
    tiny_model,
)

pytestmark = [pytest.mark.cluster]


def _scrape_config(cluster: ClusterHandle, token_file: Path, namespace: str) -> dict:
    access = ApiAccess(cluster.config.server, str(cluster.config.pki_dir / "ca.crt"), str(token_file))
    return prometheus_config(access, namespaces=[namespace], interval="2s")


def _query(url: str, promql: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}") as rsp:
        return json.loads(rsp.read())["data"]["result"]


def test_prometheus_mode_scales_on_ttft_read_from_prometheus(cluster: ClusterHandle, tmp_path):
    namespace = f"prom-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    # Prometheus's own identity: it may only watch pods in this namespace.
    cluster.kubectl("create", "serviceaccount", "prometheus", "-n", namespace)
    cluster.kubectl(
        "create", "role", "pod-reader", "-n", namespace, "--verb=get,list,watch", "--resource=pods"
    )
    token = cluster.kubectl("create", "token", "prometheus", "-n", namespace, "--duration=1h").stdout.strip()
    token_file = tmp_path / "prometheus.token"
    token_file.write_text(token)
    model = tiny_model(tmp_path / "tiny-llama")
    install_manifests(cluster)
    with PrometheusProcess(_scrape_config(cluster, token_file, namespace), tmp_path / "prom") as prom:
        operator = OperatorProcess(
            service_account_kubeconfig(cluster, tmp_path / "operator.kubeconfig"),
            tmp_path / "operator.log",
            ("--prometheus-url", prom.url),
            host_path_roots=(tmp_path,),
        )
        operator.start()
        try:
            service = inference_service(
                "chat",
                model,
                namespace,
                engine={"kvCacheMemory": "64Mi", "maxNumSeqs": 4},
                autoscaling={
                    "minReplicas": 1,
                    "maxReplicas": 2,
                    "ttftP95TargetSeconds": 0.0001,
                    "queueDepthTarget": 1000,
                    "periodSeconds": 3,
                    "ttftWindowSeconds": 60,
                },
            )
            cluster.apply(manifest_yaml.dump(service))
            status = wait_for(
                lambda: (
                    (cluster.get_json("fisvc", "chat", "-n", namespace).get("status") or {}).get("endpoints")
                    and cluster.get_json("fisvc", "chat", "-n", namespace)["status"]
                ),
                300,
                "the engine pod to be ready",
            )
            # Until its RoleBinding exists, Prometheus may not list the pods, so it has no series for the
            # ready pod, and only the Prometheus source says so: the pod itself answers /metrics all along.
            wait_for(
                lambda: (
                    "no flotilla_num_requests_waiting series in Prometheus" in operator.log_path.read_text()
                ),
                60,
                "the operator to report the pod missing from Prometheus",
            )
            cluster.kubectl("create", "rolebinding", "prometheus", "-n", namespace, "--role=pod-reader",
                            f"--serviceaccount={namespace}:prometheus")  # fmt: skip
            wait_for(
                lambda: _query(prom.url, f'up{{namespace="{namespace}"}} == 1'),
                90,
                "Prometheus to discover (kubernetes_sd) and scrape the engine pod",
            )
            endpoint = status["endpoints"][0]
            for _ in range(6):
                complete(endpoint)

            def scaled() -> dict | None:
                obj = cluster.get_json("fisvc", "chat", "-n", namespace)
                auto = (obj.get("status") or {}).get("autoscaling") or {}
                # The scale is patched before the decision's status: wait for both.
                return auto if obj["spec"]["replicas"] == 2 and auto.get("desiredReplicas") == 2 else None

            auto = wait_for(scaled, 120, "a scale-up from TTFT read through Prometheus")
            assert auto["currentMetrics"]["ttftP95Seconds"] > 0.0001, auto
            counted = _query(
                prom.url, f'sum(flotilla_time_to_first_token_seconds_count{{namespace="{namespace}"}})'
            )
            assert counted and float(counted[0]["value"][1]) >= 6
            fallback = next(c for c in auto["conditions"] if c["type"] == "MetricsFallback")
            assert fallback["status"] == "False" and fallback["reason"] == "Prometheus", fallback

            # Prometheus goes down: the autoscaler scrapes the engines itself and says so.
            prom.__exit__()

            def falling_back() -> dict | None:
                auto = cluster.get_json("fisvc", "chat", "-n", namespace)["status"].get("autoscaling") or {}
                cond = next((c for c in auto.get("conditions") or [] if c["type"] == "MetricsFallback"), {})
                return (
                    auto
                    if cond.get("status") == "True" and cond.get("reason") == "PrometheusUnavailable"
                    else None
                )

            auto = wait_for(falling_back, 60, "the MetricsFallback condition once Prometheus is gone")
            # Its signals come from the engines now: the queue depth is measured, not unknown.
            assert auto["currentMetrics"]["queueDepthPerReplica"] is not None, auto
            message = next(c for c in auto["conditions"] if c["type"] == "MetricsFallback")["message"]
            assert prom.url in message and "scraped directly" in message, message
        finally:
            # The autoscaler daemon's finalizer needs a running operator to let the service go.
            cluster.kubectl("delete", "fisvc", "chat", "-n", namespace, "--timeout=60s", check=False)
            operator.stop()
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
