"""The scrape configuration Flotilla's Prometheus uses: valid for the real promtool, and it keeps exactly
the annotated pods, at their annotated port and path."""

from __future__ import annotations

import subprocess

import pytest

from flotilla import manifest_yaml
from flotilla.cluster.paths import promtool_path
from flotilla.contract import ANNOTATION_PORT, ANNOTATION_SCRAPE, ENVOY_STATS_PATH, ENVOY_STATS_PORT_NAME
from flotilla.monitoring.local import discovery_rbac
from flotilla.monitoring.scrape import DISCOVERY_RULES, ENVOY_JOB, JOB, ApiAccess, prometheus_config


def test_promtool_accepts_the_generated_config(tmp_path):
    promtool = promtool_path()
    assert promtool.exists(), f"{promtool} is missing: run `flotilla cluster build` (make test does)"
    (tmp_path / "ca.crt").write_text("")
    (tmp_path / "token").write_text("t")
    access = ApiAccess("https://127.0.0.1:6443", str(tmp_path / "ca.crt"), str(tmp_path / "token"))
    static = {"operator": ["127.0.0.1:8080"], "envoy": ["127.0.0.1:19000/stats/prometheus"]}
    config = prometheus_config(access, namespaces=["team-a"], static_targets=static)
    path = tmp_path / "prometheus.yml"
    path.write_text(manifest_yaml.dump(config))
    result = subprocess.run(
        [str(promtool), "check", "config", "--syntax-only", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_static_target_may_name_its_path_and_a_job_has_one():
    static = {"operator": ["127.0.0.1:8080"], "envoy": ["127.0.0.1:19000/stats/prometheus"]}
    jobs = {j["job_name"]: j for j in prometheus_config(static_targets=static)["scrape_configs"]}
    assert jobs["operator"]["static_configs"] == [{"targets": ["127.0.0.1:8080"]}]
    assert "metrics_path" not in jobs["operator"]
    assert jobs["envoy"]["static_configs"] == [{"targets": ["127.0.0.1:19000"]}]
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    with pytest.raises(ValueError, match="one path per job"):
        prometheus_config(static_targets={"mixed": ["127.0.0.1:1", "127.0.0.1:2/stats/prometheus"]})


def test_the_pod_job_keeps_annotated_pods_at_their_port_and_labels_namespace_and_pod():
    (job,) = [j for j in prometheus_config()["scrape_configs"] if j["job_name"] == JOB]
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


def test_envoys_stats_are_a_job_of_their_own_kept_by_the_port_name():
    """A pod's annotations name one port (the gateway's /metrics); Envoy's stats port in the same pod is
    found by its container port's name, every other port of every pod dropped, at Envoy's path."""
    access = ApiAccess("https://127.0.0.1:6443", "/ca.crt", "/token")
    jobs = {j["job_name"]: j for j in prometheus_config(access, namespaces=["b", "a"])["scrape_configs"]}
    assert set(jobs) == {JOB, ENVOY_JOB}
    envoy = jobs[ENVOY_JOB]
    # The same discovery as the pod job: the same API access and namespaces.
    assert envoy["kubernetes_sd_configs"] == jobs[JOB]["kubernetes_sd_configs"]
    assert envoy["kubernetes_sd_configs"][0]["namespaces"] == {"names": ["a", "b"]}
    assert envoy["metrics_path"] == ENVOY_STATS_PATH == "/stats/prometheus"
    keep, *rest = envoy["relabel_configs"]
    assert keep == {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "action": "keep",
                    "regex": ENVOY_STATS_PORT_NAME}  # fmt: skip
    # Not the annotation: an annotated pod without the port is not Envoy; the target's address is the port's.
    assert not any(r.get("target_label") in ("__address__", "__metrics_path__") for r in rest)
    assert {r.get("target_label") for r in rest} == {"namespace", "pod"}


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
