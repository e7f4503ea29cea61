"""Pod Security, asked of the real API server (issue 51): each pod the chart runs, with its default values,
and each engine pod the operator builds for every kind of model source, is created with a server-side dry
run in a namespace whose `pod-security.kubernetes.io/enforce` label is `restricted` or `baseline`: the
API server's own PodSecurity admission judges it, as it would on any cluster that labels its namespaces.

- The chart's own pods (operator, gateway with its Envoy, hooks, the helm test) meet `restricted`.
- Engine pods meet `restricted` for models from pvc://, hf:// (downloaded by an init container, or from a
  node cache the platform configures: a hostPath, which is `baseline`'s business) and https://.
- A file:// model is a hostPath volume, which `baseline` forbids: it exists only where the platform team
  lists host-path roots (none by default), so with the chart's defaults every engine pod meets `baseline`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flotilla.cluster.handle import ClusterHandle
from flotilla.cluster.helm import helm
from flotilla.operator.api.v1alpha1 import InferenceServiceSpec
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.workload import Decision, Owner, deployment

pytestmark = pytest.mark.cluster
CHART = Path(__file__).resolve().parents[1] / "charts" / "flotilla"
POD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def _labelled(cluster: ClusterHandle, namespace: str, level: str) -> str:
    cluster.kubectl("label", "namespace", namespace, f"pod-security.kubernetes.io/enforce={level}",
                    "pod-security.kubernetes.io/enforce-version=latest", "--overwrite")  # fmt: skip
    return namespace


def _pod(name: str, template: dict) -> dict:
    """A Pod of the template, as its controller would create it (the ServiceAccount is the namespace's own:
    admission checks that the named one exists, which is not what is asked here)."""
    spec = {**template["spec"], "serviceAccountName": "default"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _verdict(cluster: ClusterHandle, namespace: str, pod: dict) -> str:
    """'' when the API server admits the pod (dry run: nothing is created), else its refusal."""
    done = cluster.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(pod),
                           check=False)  # fmt: skip
    return "" if done.returncode == 0 else done.stderr.strip()


def _chart_pods() -> list[tuple[str, dict]]:
    rendered = helm("template", "flotilla", str(CHART), "--namespace", "flotilla-system").stdout
    pods = []
    for doc in yaml.safe_load_all(rendered):
        if not doc:
            continue
        if doc["kind"] in POD_KINDS:
            template = doc["spec"]["template"]
            pods.append((f"{doc['kind'].lower()}-{doc['metadata']['name']}", template))
        elif doc["kind"] == "Pod":  # the helm test
            pods.append((f"pod-{doc['metadata']['name']}", {"spec": doc["spec"]}))
    return pods


def test_every_pod_of_the_chart_meets_restricted(cluster: ClusterHandle, namespace: str):
    restricted = _labelled(cluster, namespace, "restricted")
    pods = _chart_pods()
    names = [name for name, _ in pods]
    assert any("operator" in n for n in names) and any("gateway" in n for n in names), names
    refused = {
        name: why
        for name, template in pods
        if (why := _verdict(cluster, restricted, _pod(name[:60], template)))
    }
    assert refused == {}


ENGINE_SOURCES = {
    "pvc": ("pvc://models/tiny-llama", OperatorConfig()),
    "hf-download": ("hf://org/tiny-llama", OperatorConfig()),
    "https": ("https://models.example/tiny-llama.tar", OperatorConfig()),
}


@pytest.mark.parametrize("source", list(ENGINE_SOURCES))
def test_engine_pods_meet_restricted_for_models_from_claims_hubs_and_urls(
    cluster: ClusterHandle, namespace: str, source: str
):
    uri, config = ENGINE_SOURCES[source]
    restricted = _labelled(cluster, namespace, "restricted")
    assert _verdict(cluster, restricted, _engine_pod(uri, config)) == ""


def test_a_file_model_is_the_one_hostpath_and_baseline_refuses_it(cluster: ClusterHandle, namespace: str):
    config = OperatorConfig(host_path_roots=("/srv/models",))
    baseline = _labelled(cluster, namespace, "baseline")
    why = _verdict(cluster, baseline, _engine_pod("file:///srv/models/tiny-llama", config))
    assert "violates PodSecurity" in why and "hostPath" in why, why
    # Which the platform team opts into: with the chart's defaults (no roots) no engine pod has one.
    assert _verdict(cluster, baseline, _engine_pod("pvc://models/tiny-llama", OperatorConfig())) == ""


def _engine_pod(uri: str, config: OperatorConfig) -> dict:
    spec = InferenceServiceSpec.model_validate(
        {"model": {"uri": uri, "servedName": "tiny-llama"}, "resources": {"gpus": 1, "gpuType": "h100"}}
    )
    built = deployment(Owner(name="chat", namespace="team-a", uid="uid-1"), spec, Decision(tenant="team-a",
                       replicas=1), config)  # fmt: skip
    return _pod("engine", built["spec"]["template"])
