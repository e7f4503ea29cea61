"""The scrape configuration Flotilla's Prometheus uses: valid for the real promtool, and it keeps exactly
the annotated pods, at their annotated port and path."""

from __future__ import annotations

import subprocess

import yaml

from flotilla.cluster.paths import promtool_path
from flotilla.contract import ANNOTATION_PORT, ANNOTATION_SCRAPE
from flotilla.monitoring.local import discovery_rbac
from flotilla.monitoring.scrape import DISCOVERY_RULES, ApiAccess, prometheus_config


def test_promtool_accepts_the_generated_config(tmp_path):
    promtool = promtool_path()
    assert promtool.exists(), f"{promtool} is missing: run `flotilla cluster build` (make test does)"
    (tmp_path / "ca.crt").write_text("")
    (tmp_path / "token").write_text("t")
    access = ApiAccess("https://127.0.0.1:6443", str(tmp_path / "ca.crt"), str(tmp_path / "token"))
    config = prometheus_config(access, namespaces=["team-a"], static_targets={"operator": ["127.0.0.1:8080"]})
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [str(promtool), "check", "config", "--syntax-only", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_pod_job_keeps_annotated_pods_at_their_port_and_labels_namespace_and_pod():
    (job,) = [j for j in prometheus_config()["scrape_configs"] if "kubernetes_sd_configs" in j]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]  # in-cluster: no explicit credentials
    relabel = job["relabel_configs"]
    keep = relabel[0]
    assert keep["action"] == "keep" and keep["regex"] == "true"
    assert keep["source_labels"] == [
        "__meta_kubernetes_pod_annotation_" + ANNOTATION_SCRAPE.replace(".", "_").replace("/", "_")
    ]
    address = next(r for r in relabel if r.get("target_label") == "__address__")
    assert address["source_labels"][1].endswith(ANNOTATION_PORT.replace(".", "_").replace("/", "_"))
    assert {r.get("target_label") for r in relabel} >= {"namespace", "pod", "__metrics_path__"}


def test_prometheus_may_only_read_pods():
    assert DISCOVERY_RULES == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    role = next(o for o in discovery_rbac() if o["kind"] == "ClusterRole")
    assert role["rules"] == DISCOVERY_RULES


def test_the_plain_scrape_file_is_current_and_promtool_accepts_it_with_the_rules(tmp_path):
    """deploy/monitoring/ holds what a Prometheus without the operator mounts: the generated scrape
    config and the rules file; promtool loads both together."""
    import shutil
    from pathlib import Path

    from flotilla.monitoring.scrape import in_cluster_config

    deploy = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
    text = in_cluster_config("flotilla-rules.yaml")
    assert (deploy / "prometheus-scrape.yaml").read_text() == text, "run `flotilla monitoring scrape`"
    shutil.copy(deploy / "flotilla-rules.yaml", tmp_path / "flotilla-rules.yaml")
    (tmp_path / "prometheus.yml").write_text(text)
    promtool = promtool_path()
    assert promtool.exists(), f"{promtool} is missing: run `flotilla cluster build` (make test does)"
    result = subprocess.run(
        [str(promtool), "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and "rules found" in result.stdout
