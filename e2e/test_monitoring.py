"""`flotilla monitoring up` on the local cluster: the real Prometheus finds annotated pods through the API
server (kubernetes_sd) as a ServiceAccount that may only read pods, scrapes them with `namespace` and
`pod` labels, leaves unannotated pods alone, scrapes a sidecar's port named `envoy-stats` at
/stats/prometheus (Envoy in the gateway pod) in a job of its own, and loads Flotilla's recording rules and
alerts."""

from __future__ import annotations

import json
import sys
import urllib.parse
import urllib.request
import uuid

import pytest

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle, wait_for
from flotilla.cluster.processes import ProcessTable
from flotilla.contract import ANNOTATION_PATH, ANNOTATION_PORT, ANNOTATION_SCRAPE, ENVOY_STATS_PORT_NAME
from flotilla.monitoring import local
from flotilla.monitoring.rules import render
from flotilla.monitoring.scrape import ENVOY_JOB, JOB

pytestmark = pytest.mark.cluster

# A pod that serves one gauge on $POD_IP:9400 (the node agent runs it as a host process).
EXPORTER = (
    "import os, time; from prometheus_client import Gauge, start_http_server; "
    "Gauge('flotilla_probe_value', 'a value to find').set(42); "
    "start_http_server(9400, addr=os.environ['POD_IP']); time.sleep(3600)"
)


def _exporter(port: int, gauge: str, value: int) -> str:
    return (
        EXPORTER.replace("9400", str(port))
        .replace("flotilla_probe_value", gauge)
        .replace("set(42)", f"set({value})")
    )


def _proxy_pod() -> dict:
    """The gateway pod's shape: annotated for its main container's /metrics, and a sidecar (an init container
    that keeps running, as Envoy is) whose port named `envoy-stats` serves /stats/prometheus."""
    pod = _pod("proxy", True)
    pod["spec"]["initContainers"] = [{
        "name": "envoy",
        "image": "python",
        "restartPolicy": "Always",
        "command": [sys.executable, "-c", _exporter(9401, "envoy_probe_value", 7)],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": ENVOY_STATS_PORT_NAME, "containerPort": 9401}],
    }]  # fmt: skip
    return pod


def _pod(name: str, annotated: bool) -> dict:
    notes = (
        {ANNOTATION_SCRAPE: "true", ANNOTATION_PORT: "9400", ANNOTATION_PATH: "/metrics"} if annotated else {}
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": notes},
        "spec": {
            "containers": [
                {
                    "name": "exporter",
                    "image": "python",
                    "command": [sys.executable, "-c", EXPORTER],
                    "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                }
            ]
        },
    }


def _query(url: str, promql: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}") as rsp:
        return json.loads(rsp.read())["data"]["result"]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url) as rsp:
        return json.loads(rsp.read())


def test_monitoring_up_discovers_annotated_pods_with_least_privilege(cluster: ClusterHandle, tmp_path):
    namespace = f"mon-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    cluster.apply(
        manifest_yaml.dump_all([_pod("scraped", True), _pod("ignored", False), _proxy_pod()]), namespace
    )
    rules = tmp_path / "flotilla-rules.yaml"
    rules.write_text(render())
    url = local.up(cluster, tmp_path, rule_files=[str(rules)], log=lambda _: None)
    try:
        # The proxy pod's main container is annotated too: wait for this pod's series by name (which of
        # the two is scraped first is the scheduler's choice); the targets below show the unannotated pod
        # is not scraped.
        found = wait_for(
            lambda: _query(url, f'flotilla_probe_value{{namespace="{namespace}", pod="scraped"}}'),
            120,
            "Prometheus to discover and scrape the annotated pod",
        )
        assert float(found[0]["value"][1]) == 42
        # Envoy's stats: the second job keeps the sidecar's port by its name, at /stats/prometheus.
        envoy = wait_for(
            lambda: _query(url, f'envoy_probe_value{{namespace="{namespace}"}}'),
            120,
            "Prometheus to scrape the sidecar's envoy-stats port",
        )
        assert [(s["metric"]["pod"], s["metric"]["job"]) for s in envoy] == [("proxy", ENVOY_JOB)]
        assert float(envoy[0]["value"][1]) == 7
        wait_for(lambda: len(_query(url, f'flotilla_probe_value{{namespace="{namespace}"}}')) == 2, 120,
                 "the annotated port of the proxy pod to be scraped too")  # fmt: skip
        targets = _get(f"{url}/api/v1/targets")["data"]["activeTargets"]
        jobs = {
            (t["labels"].get("pod"), t["labels"]["job"], t["scrapeUrl"].rsplit(":", 1)[1].split("/", 1)[1])
            for t in targets
            if t["labels"].get("namespace") == namespace
        }
        # The unannotated pod is not a target; the proxy pod is one per job, each at its own port and path.
        assert jobs == {("scraped", JOB, "metrics"), ("proxy", JOB, "metrics"),
                        ("proxy", ENVOY_JOB, "stats/prometheus")}, jobs  # fmt: skip
        ports = {t["scrapeUrl"].rsplit(":", 1)[1].split("/")[0] for t in targets
                 if t["labels"].get("pod") == "proxy"}  # fmt: skip
        assert ports == {"9400", "9401"}

        account = f"system:serviceaccount:{local.NAMESPACE}:{local.ACCOUNT}"
        for verb, resource, allowed in (("list", "pods", "yes"), ("watch", "pods", "yes"),
                                        ("list", "secrets", "no"), ("list", "services", "no")):  # fmt: skip
            answer = cluster.kubectl("auth", "can-i", verb, resource, "-A", "--as", account, check=False)
            assert answer.stdout.strip() == allowed, (verb, resource, answer.stdout, answer.stderr)

        groups = _get(f"{url}/api/v1/rules")["data"]["groups"]
        names = {rule["name"] for group in groups for rule in group["rules"]}
        assert any(name.startswith("flotilla:") for name in names)
        assert any(name.startswith("Flotilla") for name in names)  # the alerts
    finally:
        ProcessTable(tmp_path / "pids").stop(local.PROCESS)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
