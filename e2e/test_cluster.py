"""The local cluster behaves like a Kubernetes cluster: real scheduling, admission, RBAC and pod lifecycles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle, wait_for

pytestmark = pytest.mark.cluster


def _pod(cluster: ClusterHandle, namespace: str, name: str) -> dict:
    return cluster.get_json("pod", name, "-n", namespace)


def _pods(cluster: ClusterHandle, namespace: str, selector: str) -> list[dict]:
    return cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]


def _ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_what_flotilla_writes_as_yaml_the_api_server_reads_as_the_same_strings(
    cluster: ClusterHandle, namespace: str
):
    """Strings Go's YAML takes for numbers when plain (a run id of `766e7` once reached the API server
    as 7.66e9 and the Tenant was refused): written through flotilla.manifest_yaml, each comes back."""
    as_labels = ["766e7", "1e3", "0755", "1_000", "12345", "0x1F", "0b101"]
    as_data = [*as_labels, "0o17", "+Inf", "-.5", ".5"]
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "yaml-strings", "labels": {f"l{i}": v for i, v in enumerate(as_labels)}},
        "data": {f"d{i}": v for i, v in enumerate(as_data)},
    }
    cluster.apply(manifest_yaml.dump(config_map), namespace)
    stored = cluster.get_json("configmap", "yaml-strings", "-n", namespace)
    assert stored["metadata"]["labels"] == config_map["metadata"]["labels"]
    assert stored["data"] == config_map["data"]


def test_nodes_have_gpu_capacity_and_type(cluster: ClusterHandle):
    nodes = cluster.get_json("nodes", "-l", "flotilla.dev/node-agent=true")["items"]
    assert len(nodes) >= 2
    for node in nodes:
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
        assert node["metadata"]["labels"]["flotilla.dev/gpu-type"] == "h100"


def test_version_reports_the_pinned_release(cluster: ClusterHandle):
    from flotilla.cluster.versions import KUBERNETES_VERSION

    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == KUBERNETES_VERSION


def test_deployment_runs_an_http_server_on_its_pod_ip(cluster: ClusterHandle, namespace: str):
    manifest = textwrap.dedent(f"""
        apiVersion: apps/v1
        kind: Deployment
        metadata: {{name: web}}
        spec:
          replicas: 1
          selector: {{matchLabels: {{app: web}}}}
          template:
            metadata: {{labels: {{app: web}}}}
            spec:
              terminationGracePeriodSeconds: 5
              containers:
              - name: web
                image: python
                command: ["{sys.executable}", "-m", "http.server", "--bind", "$(POD_IP)", "8080"]
                env:
                - name: POD_IP
                  valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}
                ports: [{{containerPort: 8080, name: http}}]
                readinessProbe: {{httpGet: {{path: /, port: http}}, periodSeconds: 1}}
        """)
    cluster.apply(manifest, namespace)
    pod = wait_for(
        lambda: next((p for p in _pods(cluster, namespace, "app=web") if _ready(p)), None),
        60,
        "the web pod to be Running and Ready",
    )
    assert pod["status"]["phase"] == "Running"
    ip = pod["status"]["podIP"]
    assert ip.startswith("127.") and not ip.startswith("127.0.0.")
    answer = subprocess.run(
        ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", f"http://{ip}:8080/"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert answer.stdout == "200", answer.stderr
    pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("flotilla://"))
    assert _pid_alive(pid)

    cluster.kubectl("delete", "deployment", "web", "-n", namespace)
    wait_for(lambda: not _pods(cluster, namespace, "app=web"), 60, "the web pod to be removed")
    wait_for(lambda: not _pid_alive(pid), 10, f"process {pid} to end")


def test_pod_asking_for_more_gpus_than_any_node_stays_pending(cluster: ClusterHandle, namespace: str):
    manifest = textwrap.dedent("""
        apiVersion: v1
        kind: Pod
        metadata: {name: greedy}
        spec:
          containers:
          - name: main
            image: none
            command: ["sleep", "600"]
            resources: {limits: {nvidia.com/gpu: 64}}
        """)
    cluster.apply(manifest, namespace)

    def unschedulable():
        conditions = (_pod(cluster, namespace, "greedy").get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "PodScheduled" and c["status"] == "False"), None)

    condition = wait_for(unschedulable, 60, "the scheduler to report the pod unschedulable")
    assert condition["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in condition["message"]
    assert _pod(cluster, namespace, "greedy")["status"]["phase"] == "Pending"


def test_resource_quota_on_gpus_rejects_an_excess_pod(cluster: ClusterHandle, namespace: str):
    cluster.apply(
        textwrap.dedent("""
        apiVersion: v1
        kind: ResourceQuota
        metadata: {name: gpus}
        spec: {hard: {requests.nvidia.com/gpu: "2"}}
        """),
        namespace,
    )
    wait_for(
        lambda: (cluster.get_json("resourcequota", "gpus", "-n", namespace).get("status") or {}).get("hard"),
        60,
        "the quota controller to fill the quota's status",
    )
    pod = textwrap.dedent("""
        apiVersion: v1
        kind: Pod
        metadata: {name: NAME}
        spec:
          containers:
          - {name: main, image: none, command: ["sleep", "600"], resources: {limits: {nvidia.com/gpu: GPUS}}}
        """)
    cluster.apply(pod.replace("NAME", "fits").replace("GPUS", "2"), namespace)
    refused = cluster.kubectl(
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        check=False,
        input=pod.replace("NAME", "excess").replace("GPUS", "1"),
    )
    assert refused.returncode != 0
    assert "exceeded quota" in refused.stderr and "requests.nvidia.com/gpu" in refused.stderr


def test_service_account_without_rbac_is_forbidden(cluster: ClusterHandle, namespace: str):
    cluster.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    token = cluster.kubectl("create", "token", "nobody", "-n", namespace).stdout.strip()
    denied = subprocess.run(
        [*_kubectl_base(cluster), f"--token={token}", "get", "pods", "-n", namespace],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr and f"system:serviceaccount:{namespace}:nobody" in denied.stderr


def _kubectl_base(cluster: ClusterHandle) -> list[str]:
    """kubectl against the cluster with only its CA: no admin client certificate."""
    from flotilla.cluster.control_plane import kubectl_path

    return [
        str(kubectl_path()),
        f"--server={cluster.config.server}",
        f"--certificate-authority={cluster.config.pki_dir / 'ca.crt'}",
        "--kubeconfig=/dev/null",
    ]


def test_crashing_container_is_restarted(cluster: ClusterHandle, namespace: str):
    cluster.apply(
        textwrap.dedent("""
        apiVersion: v1
        kind: Pod
        metadata: {name: crasher}
        spec:
          containers:
          - {name: main, image: none, command: ["sh", "-c", "echo dying; exit 3"]}
        """),
        namespace,
    )

    def restarted_twice():
        statuses = (_pod(cluster, namespace, "crasher").get("status") or {}).get("containerStatuses") or []
        return statuses[0] if statuses and statuses[0]["restartCount"] >= 2 else None

    status = wait_for(restarted_twice, 60, "restartCount to reach 2")
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert status["lastState"]["terminated"]["reason"] == "Error"
