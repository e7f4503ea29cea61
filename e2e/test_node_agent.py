"""The node agent's kubelet duties: env from ConfigMaps and Secrets, probes, and graceful termination."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from flotilla.cluster.handle import ClusterHandle, wait_for

pytestmark = pytest.mark.cluster


def _container_log(cluster: ClusterHandle, namespace: str, pod: str, container: str) -> str:
    path = cluster.config.state_dir / "pods" / "logs" / f"{namespace}_{pod}" / f"{container}.log"
    return path.read_text() if path.exists() else ""


def _status(cluster: ClusterHandle, namespace: str, pod: str) -> dict:
    return cluster.get_json("pod", pod, "-n", namespace).get("status") or {}


def test_env_from_config_map_secret_and_downward_api(cluster: ClusterHandle, namespace: str):
    cluster.kubectl("create", "configmap", "settings", "-n", namespace, "--from-literal=model=tiny-llama")
    cluster.kubectl("create", "secret", "generic", "creds", "-n", namespace, "--from-literal=api-key=s3cret")
    cluster.apply(
        textwrap.dedent("""
        apiVersion: v1
        kind: Pod
        metadata: {name: envy, labels: {team: a}}
        spec:
          containers:
          - name: main
            image: none
            command: ["sh", "-c", "echo MODEL=$MODEL KEY=$KEY IP=$POD_IP NS=$NS TEAM=$TEAM ARG=$(MODEL); sleep 600"]
            env:
            - {name: MODEL, valueFrom: {configMapKeyRef: {name: settings, key: model}}}
            - {name: KEY, valueFrom: {secretKeyRef: {name: creds, key: api-key}}}
            - {name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}
            - {name: NS, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
            - {name: TEAM, valueFrom: {fieldRef: {fieldPath: "metadata.labels['team']"}}}
        """),
        namespace,
    )
    line = wait_for(
        lambda: _container_log(cluster, namespace, "envy", "main").strip(), 60, "the pod's output"
    )
    ip = _status(cluster, namespace, "envy")["podIP"]
    assert line == f"MODEL=tiny-llama KEY=s3cret IP={ip} NS={namespace} TEAM=a ARG=tiny-llama"


def test_missing_config_map_holds_the_container_with_a_reason(cluster: ClusterHandle, namespace: str):
    cluster.apply(
        textwrap.dedent("""
        apiVersion: v1
        kind: Pod
        metadata: {name: orphan-ref}
        spec:
          containers:
          - name: main
            image: none
            command: ["sleep", "600"]
            env: [{name: X, valueFrom: {configMapKeyRef: {name: absent, key: k}}}]
        """),
        namespace,
    )

    def waiting():
        statuses = _status(cluster, namespace, "orphan-ref").get("containerStatuses") or []
        return (statuses[0]["state"].get("waiting") or {}) if statuses else None

    state = wait_for(
        lambda: (w := waiting()) and w.get("reason") == "CreateContainerConfigError" and w,
        60,
        "CreateContainerConfigError",
    )
    assert "absent" in state["message"]


def test_failing_liveness_probe_restarts_and_readiness_gates_ready(cluster: ClusterHandle, namespace: str):
    server = f"{sys.executable} -m http.server --bind $(POD_IP) 8080"
    cluster.apply(
        textwrap.dedent(f"""
        apiVersion: v1
        kind: Pod
        metadata: {{name: unhealthy}}
        spec:
          containers:
          - name: main
            image: none
            command: ["sh", "-c", "exec {server}"]
            env: [{{name: POD_IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}]
            startupProbe: {{tcpSocket: {{port: 8080}}, periodSeconds: 1, failureThreshold: 30}}
            readinessProbe: {{httpGet: {{path: /missing, port: 8080}}, periodSeconds: 1}}
            livenessProbe: {{httpGet: {{path: /missing, port: 8080}}, periodSeconds: 1, failureThreshold: 2}}
        """),
        namespace,
    )

    def restarted():
        statuses = _status(cluster, namespace, "unhealthy").get("containerStatuses") or []
        return statuses[0] if statuses and statuses[0]["restartCount"] >= 1 else None

    status = wait_for(restarted, 90, "a restart after the liveness probe fails")
    assert status["lastState"]["terminated"]["message"] == "liveness probe failed"
    assert status["ready"] is False
    assert "404" in _container_log(cluster, namespace, "unhealthy", "main")


STUBBORN = """
import signal, time

def term(*_):
    print("got SIGTERM, ignoring it", flush=True)

signal.signal(signal.SIGTERM, term)
print("started", flush=True)
while True:
    time.sleep(0.1)
"""


def test_deletion_sends_sigterm_then_sigkill_after_the_grace_period(
    cluster: ClusterHandle, namespace: str, tmp_path
):
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    cluster.apply(
        textwrap.dedent(f"""
        apiVersion: v1
        kind: Pod
        metadata: {{name: stubborn}}
        spec:
          terminationGracePeriodSeconds: 2
          containers:
          - {{name: main, image: none, command: ["{sys.executable}", "{script}"]}}
        """),
        namespace,
    )
    wait_for(
        lambda: "started" in _container_log(cluster, namespace, "stubborn", "main"),
        60,
        "the process to start",
    )
    pid = int(_status(cluster, namespace, "stubborn")["containerStatuses"][0]["containerID"].split("//")[1])
    cluster.kubectl("delete", "pod", "stubborn", "-n", namespace, "--wait=true", timeout=60)
    assert "got SIGTERM, ignoring it" in _container_log(cluster, namespace, "stubborn", "main")

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, 10, f"process {pid} to be killed")


def test_pods_find_flotilla_although_the_agent_path_lacks_the_venv(cluster: ClusterHandle, namespace: str):
    # conftest starts the cluster with the virtual environment's bin folder taken off PATH.
    cluster.apply(
        textwrap.dedent("""
        apiVersion: v1
        kind: Pod
        metadata: {name: flotilla-help}
        spec:
          restartPolicy: Never
          containers:
          - {name: main, image: none, command: ["flotilla", "--help"]}
        """),
        namespace,
    )

    def finished() -> dict:
        status = _status(cluster, namespace, "flotilla-help")
        # A command the agent cannot start keeps the pod Pending; the failure then shows the reason.
        states = [container.get("state") for container in status.get("containerStatuses") or []]
        assert status.get("phase") in ("Succeeded", "Failed"), f"{status.get('phase')}: {states}"
        return status

    status = wait_for(finished, 60, "the pod to finish")
    assert status["phase"] == "Succeeded", (
        _container_log(cluster, namespace, "flotilla-help", "main") or status
    )
