"""The autoscaler's Prometheus mode on the local cluster.

A real Prometheus (Debian's package) finds the engine pods the way the usual `kubernetes-pods` job does:
kubernetes_sd_configs against the local API server with its own ServiceAccount token, keeping pods
annotated `prometheus.io/scrape`, and labelling series with `namespace` and `pod`. The operator runs with
`--prometheus-url` and reads TTFT p95 and queue depth from it with PromQL. The TTFT target is set far
below what any request takes, so a little traffic must scale the service from 1 to 2, and only data read
from Prometheus can make it do so.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid

import pytest
import yaml

from flotilla.cluster.handle import ClusterHandle, wait_for
from flotilla.cluster.prometheus import BINARY, PrometheusProcess
from flotilla.operator.local import OperatorProcess, install_manifests, service_account_kubeconfig

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        BINARY is None, reason="needs the prometheus binary (scripts/bootstrap.sh installs it)"
    ),
]


def _scrape_config(cluster: ClusterHandle, namespace: str, token_file: str) -> dict:
    relabel = [
        {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "action": "keep", "regex": "true"},
        {
            "source_labels": ["__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port"],
            "regex": r"([^:]+)(?::\d+)?;(\d+)",
            "replacement": "$1:$2",
            "target_label": "__address__",
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    ]  # fmt: skip
    return {
        "global": {"scrape_interval": "2s", "scrape_timeout": "2s"},
        "scrape_configs": [
            {
                "job_name": "kubernetes-pods",
                "kubernetes_sd_configs": [
                    {
                        "role": "pod",
                        "api_server": cluster.config.server,
                        "tls_config": {"ca_file": str(cluster.config.pki_dir / "ca.crt")},
                        "authorization": {"credentials_file": token_file},
                        "namespaces": {"names": [namespace]},
                    }
                ],
                "relabel_configs": relabel,
            }
        ],
    }


def _query(url: str, promql: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}") as rsp:
        return json.loads(rsp.read())["data"]["result"]


def _complete(endpoint: str) -> None:
    body = json.dumps({"model": "tiny", "prompt": "Hello there", "max_tokens": 8}).encode()
    request = urllib.request.Request(
        f"{endpoint}/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as rsp:
        assert rsp.status == 200


def test_prometheus_mode_scales_on_ttft_read_from_prometheus(cluster: ClusterHandle, tmp_path):
    namespace = f"prom-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    # Prometheus's own identity: it may only watch pods in this namespace.
    cluster.kubectl("create", "serviceaccount", "prometheus", "-n", namespace)
    cluster.kubectl(
        "create", "role", "pod-reader", "-n", namespace, "--verb=get,list,watch", "--resource=pods"
    )
    cluster.kubectl("create", "rolebinding", "prometheus", "-n", namespace, "--role=pod-reader",
                    f"--serviceaccount={namespace}:prometheus")  # fmt: skip
    token = cluster.kubectl("create", "token", "prometheus", "-n", namespace, "--duration=1h").stdout.strip()
    (tmp_path / "token").write_text(token)
    model = tmp_path / "tiny-llama"
    subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "model", "init", "--preset", "tiny-llama", str(model)],
        check=True,
        capture_output=True,
    )
    install_manifests(cluster)
    with PrometheusProcess(
        _scrape_config(cluster, namespace, str(tmp_path / "token")), tmp_path / "prom"
    ) as prom:
        operator = OperatorProcess(
            service_account_kubeconfig(cluster, tmp_path / "operator.kubeconfig"),
            tmp_path / "operator.log",
            ("--prometheus-url", prom.url),
        )
        operator.start()
        try:
            service = {
                "apiVersion": "flotilla.dev/v1alpha1",
                "kind": "InferenceService",
                "metadata": {"name": "chat", "namespace": namespace},
                "spec": {
                    "model": {"uri": f"file://{model}", "servedName": "tiny"},
                    "resources": {"gpus": 1, "gpuType": "h100"},
                    "engine": {"kvCacheMemory": "64Mi", "maxNumSeqs": 4},
                    "replicas": 1,
                    "autoscaling": {
                        "minReplicas": 1,
                        "maxReplicas": 2,
                        "ttftP95TargetSeconds": 0.0001,
                        "queueDepthTarget": 1000,
                        "periodSeconds": 3,
                        "ttftWindowSeconds": 60,
                    },
                },
            }
            cluster.apply(yaml.safe_dump(service))
            status = wait_for(
                lambda: (
                    (cluster.get_json("fisvc", "chat", "-n", namespace).get("status") or {}).get("endpoints")
                    and cluster.get_json("fisvc", "chat", "-n", namespace)["status"]
                ),
                300,
                "the engine pod to be ready",
            )
            wait_for(
                lambda: _query(prom.url, f'up{{namespace="{namespace}"}} == 1'),
                90,
                "Prometheus to discover and scrape the engine pod through the API server",
            )
            endpoint = status["endpoints"][0]
            for _ in range(6):
                _complete(endpoint)

            def scaled() -> dict | None:
                obj = cluster.get_json("fisvc", "chat", "-n", namespace)
                auto = (obj.get("status") or {}).get("autoscaling") or {}
                return auto if obj["spec"]["replicas"] == 2 else None

            auto = wait_for(scaled, 120, "a scale-up from TTFT read through Prometheus")
            assert auto["currentMetrics"]["ttftP95Seconds"] > 0.0001, auto
            counted = _query(
                prom.url, f'sum(flotilla_time_to_first_token_seconds_count{{namespace="{namespace}"}})'
            )
            assert counted and float(counted[0]["value"][1]) >= 6
        finally:
            # The autoscaler daemon's finalizer needs a running operator to let the service go.
            cluster.kubectl("delete", "fisvc", "chat", "-n", namespace, "--timeout=60s", check=False)
            operator.stop()
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
