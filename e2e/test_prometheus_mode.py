"""The autoscaler's Prometheus mode on the local cluster.

A real Prometheus (Debian's package) scrapes the engine pods with the labels the usual `kubernetes-pods`
job gives, `namespace` and `pod`. Debian builds Prometheus without kubernetes_sd_configs, so the test does
that discovery itself: it lists the pods annotated `prometheus.io/scrape` through the API server, as a
ServiceAccount allowed to read only pods there, and writes them to a file_sd target file. The operator runs with
`--prometheus-url` and reads TTFT p95 and queue depth from it with PromQL. The TTFT target is set far
below what any request takes, so a little traffic must scale the service from 1 to 2, and only data read
from Prometheus can make it do so.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from flotilla.cluster.handle import ClusterHandle, wait_for
from flotilla.cluster.prometheus import BINARY, PrometheusProcess
from flotilla.operator.cmd.local import (
    OperatorProcess,
    complete,
    inference_service,
    install_manifests,
    kubeconfig_for,
    service_account_kubeconfig,
    tiny_model,
)

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        BINARY is None, reason="needs the prometheus binary (scripts/bootstrap.sh installs it)"
    ),
]


def _scrape_config(targets_file: Path) -> dict:
    return {
        "global": {"scrape_interval": "2s", "scrape_timeout": "2s"},
        "scrape_configs": [
            {
                "job_name": "kubernetes-pods",
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "2s"}],
            }
        ],
    }


def _discover(kubeconfig: Path, namespace: str, targets_file: Path) -> None:
    """What kubernetes_sd plus the usual relabeling would find: annotated pods with an IP."""
    from flotilla.cluster.control_plane import kubectl_path

    result = subprocess.run(
        [str(kubectl_path()), f"--kubeconfig={kubeconfig}", "get", "pods", "-n", namespace, "-o", "json"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    groups = []
    for pod in json.loads(result.stdout)["items"]:
        notes = pod["metadata"].get("annotations") or {}
        ip = (pod.get("status") or {}).get("podIP")
        if notes.get("prometheus.io/scrape") == "true" and ip:
            groups.append(
                {
                    "targets": [f"{ip}:{notes.get('prometheus.io/port', '80')}"],
                    "labels": {"namespace": namespace, "pod": pod["metadata"]["name"]},
                }
            )
    partial = targets_file.with_suffix(".partial")
    partial.write_text(json.dumps(groups))
    partial.replace(targets_file)  # atomic: Prometheus never reads half a file


class Discovery(threading.Thread):
    def __init__(self, kubeconfig: Path, namespace: str, targets_file: Path):
        super().__init__(daemon=True)
        self.args = (kubeconfig, namespace, targets_file)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(subprocess.SubprocessError, ValueError):  # the next round retries
                _discover(*self.args)
            self.stop.wait(2)


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
    cluster.kubectl("create", "rolebinding", "prometheus", "-n", namespace, "--role=pod-reader",
                    f"--serviceaccount={namespace}:prometheus")  # fmt: skip
    token = cluster.kubectl("create", "token", "prometheus", "-n", namespace, "--duration=1h").stdout.strip()
    discovery_kubeconfig = kubeconfig_for(cluster, tmp_path / "prometheus.kubeconfig", {"token": token})
    targets_file = tmp_path / "targets.json"
    targets_file.write_text("[]")
    model = tiny_model(tmp_path / "tiny-llama")
    install_manifests(cluster)
    discovery = Discovery(discovery_kubeconfig, namespace, targets_file)
    with PrometheusProcess(_scrape_config(targets_file), tmp_path / "prom") as prom:
        operator = OperatorProcess(
            service_account_kubeconfig(cluster, tmp_path / "operator.kubeconfig"),
            tmp_path / "operator.log",
            ("--prometheus-url", prom.url),
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
            cluster.apply(yaml.safe_dump(service))
            status = wait_for(
                lambda: (
                    (cluster.get_json("fisvc", "chat", "-n", namespace).get("status") or {}).get("endpoints")
                    and cluster.get_json("fisvc", "chat", "-n", namespace)["status"]
                ),
                300,
                "the engine pod to be ready",
            )
            # Before discovery runs, Prometheus has no series for the ready pod, and only the Prometheus
            # source says so: the pod itself answers /metrics all along.
            wait_for(
                lambda: (
                    "no flotilla_num_requests_waiting series in Prometheus" in operator.log_path.read_text()
                ),
                60,
                "the operator to report the pod missing from Prometheus",
            )
            discovery.start()
            wait_for(
                lambda: _query(prom.url, f'up{{namespace="{namespace}"}} == 1'),
                90,
                "Prometheus to scrape the discovered engine pod",
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
        finally:
            # The autoscaler daemon's finalizer needs a running operator to let the service go.
            cluster.kubectl("delete", "fisvc", "chat", "-n", namespace, "--timeout=60s", check=False)
            operator.stop()
            discovery.stop.set()
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
