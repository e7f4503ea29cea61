"""What a kubelet gives a pod, from the node agent: in-cluster API access (service env, a bound
ServiceAccount token, ca.crt, namespace), volumes at their mountPaths, and init containers in order."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from flotilla.cluster.handle import ClusterHandle, wait_for

pytestmark = pytest.mark.cluster

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# Mount paths are created on the host (empty) by the agent; keep them under one folder of their own.

# Runs in the pod: everything it finds goes to out.json in a hostPath volume the test reads.
IN_CLUSTER = f"""
import json, os, ssl, urllib.request
out = {{}}
sa = "{SA_DIR}"
token = open(sa + "/token").read()
namespace = open(sa + "/namespace").read()
out["namespace"] = namespace
url = "https://%s:%s/api/v1/namespaces/%s/pods/%s" % (
    os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"], namespace, os.environ["POD_NAME"])
request = urllib.request.Request(url, headers={{"Authorization": "Bearer " + token}})
context = ssl.create_default_context(cafile=sa + "/ca.crt")
with urllib.request.urlopen(request, context=context, timeout=30) as response:
    out["self_uid"] = json.load(response)["metadata"]["uid"]
from kubernetes import client, config
config.load_incluster_config()
pod = client.CoreV1Api().read_namespaced_pod(os.environ["POD_NAME"], namespace)
out["client_uid"] = pod.metadata.uid
out["model"] = open("/mnt/flotilla-e2e/settings/model").read()
out["api_key"] = open("/mnt/flotilla-e2e/creds/api-key").read()
out["from_init"] = open("/mnt/flotilla-e2e/work/msg").read().strip()
try:
    open(sa + "/extra", "w")
    out["token_dir_writable"] = True
except OSError:
    out["token_dir_writable"] = False
os.makedirs("/mnt/flotilla-e2e/results", exist_ok=True)
with open("/mnt/flotilla-e2e/results/out.json.tmp", "w") as f:
    json.dump(out, f)
os.replace("/mnt/flotilla-e2e/results/out.json.tmp", "/mnt/flotilla-e2e/results/out.json")
"""

NO_TOKEN = f"""
import json, os
json.dump({{"token": os.path.exists("{SA_DIR}/token"), "host": os.environ.get("KUBERNETES_SERVICE_HOST")}},
          open("/mnt/flotilla-e2e/results/out.json", "w"))
"""


def _status(cluster: ClusterHandle, namespace: str, pod: str) -> dict:
    return cluster.get_json("pod", pod, "-n", namespace).get("status") or {}


def _logs(cluster: ClusterHandle, namespace: str, pod: str) -> str:
    folder = cluster.config.state_dir / "pods" / "logs" / f"{namespace}_{pod}"
    return (
        "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(folder.glob("*.log")))
        if folder.exists()
        else ""
    )


def _with_phase(cluster: ClusterHandle, namespace: str, pod: str, phases: tuple[str, ...]) -> dict | None:
    status = _status(cluster, namespace, pod)
    return status if status.get("phase") in phases else None


def _finished(cluster: ClusterHandle, namespace: str, pod: str, timeout: float = 120) -> dict:
    status = wait_for(
        lambda: _with_phase(cluster, namespace, pod, ("Succeeded", "Failed")), timeout, f"pod {pod} to finish"
    )
    assert status is not None and status["phase"] == "Succeeded", _logs(cluster, namespace, pod) or status
    return status


def _condition(status: dict, kind: str) -> str | None:
    return next((c["status"] for c in status.get("conditions") or [] if c["type"] == kind), None)


def _python_container(name: str, script: str, mounts: list[dict], env: list[dict] | None = None) -> dict:
    return {
        "name": name,
        "image": "none",
        "command": ["python", "-c", script],
        "env": env or [],
        "volumeMounts": mounts,
    }


def _pod(name: str, spec: dict) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})


def test_a_pod_uses_in_cluster_config_and_its_volumes(cluster: ClusterHandle, namespace: str, tmp_path: Path):
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    cluster.kubectl("create", "role", "pod-reader", "--verb=get", "--resource=pods", "-n", namespace)
    cluster.kubectl(
        "create",
        "rolebinding",
        "reader",
        "--role=pod-reader",
        f"--serviceaccount={namespace}:reader",
        "-n",
        namespace,
    )
    cluster.kubectl("create", "configmap", "settings", "-n", namespace, "--from-literal=model=tiny-llama")
    cluster.kubectl("create", "secret", "generic", "creds", "-n", namespace, "--from-literal=api-key=s3cret")
    results = tmp_path / "results"
    init = {
        "name": "prepare",
        "image": "none",
        "command": ["sh", "-c", "echo from-init > /mnt/flotilla-e2e/work/msg"],
        "volumeMounts": [{"name": "work", "mountPath": "/mnt/flotilla-e2e/work"}],
    }
    main = _python_container(
        "main",
        IN_CLUSTER,
        [
            {"name": "work", "mountPath": "/mnt/flotilla-e2e/work", "readOnly": True},
            {"name": "settings", "mountPath": "/mnt/flotilla-e2e/settings"},
            {"name": "creds", "mountPath": "/mnt/flotilla-e2e/creds", "readOnly": True},
            {"name": "results", "mountPath": "/mnt/flotilla-e2e/results"},
        ],
        [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
    )
    spec = {
        "serviceAccountName": "reader",
        "restartPolicy": "Never",
        "initContainers": [init],
        "containers": [main],
        "volumes": [
            {"name": "work", "emptyDir": {}},
            {"name": "settings", "configMap": {"name": "settings"}},
            {"name": "creds", "secret": {"secretName": "creds"}},
            {"name": "results", "hostPath": {"path": str(results), "type": "DirectoryOrCreate"}},
        ],
    }
    cluster.apply(_pod("in-cluster", spec), namespace)
    _finished(cluster, namespace, "in-cluster")
    out = json.loads((results / "out.json").read_text())
    uid = cluster.get_json("pod", "in-cluster", "-n", namespace)["metadata"]["uid"]
    assert out == {
        "namespace": namespace,
        "self_uid": uid,
        "client_uid": uid,
        "model": "tiny-llama",
        "api_key": "s3cret",
        "from_init": "from-init",
        "token_dir_writable": False,
    }
    # The pod's staged volumes go with it.
    staged = cluster.config.state_dir / "pods" / "volumes"
    assert any(p.name.startswith(f"{namespace}_in-cluster_") for p in staged.iterdir())
    cluster.kubectl("delete", "pod", "in-cluster", "-n", namespace, "--wait=true", timeout=60)
    wait_for(
        lambda: not any(p.name.startswith(f"{namespace}_in-cluster_") for p in staged.iterdir()),
        30,
        "the pod's staged volumes to be removed",
    )


def test_automount_false_gets_no_token_but_the_service_env(
    cluster: ClusterHandle, namespace: str, tmp_path: Path
):
    results = tmp_path / "results"
    spec = {
        "automountServiceAccountToken": False,
        "restartPolicy": "Never",
        "containers": [
            _python_container(
                "main", NO_TOKEN, [{"name": "results", "mountPath": "/mnt/flotilla-e2e/results"}]
            )
        ],
        "volumes": [{"name": "results", "hostPath": {"path": str(results), "type": "DirectoryOrCreate"}}],
    }
    cluster.apply(_pod("no-token", spec), namespace)
    _finished(cluster, namespace, "no-token")
    out = json.loads((results / "out.json").read_text())
    assert out == {"token": False, "host": "127.0.0.1"}


def test_init_containers_run_in_order_and_a_failing_one_is_retried(
    cluster: ClusterHandle, namespace: str, tmp_path: Path
):
    trace, marker = tmp_path / "trace", tmp_path / "go"
    spec = {
        "automountServiceAccountToken": False,
        "initContainers": [
            {"name": "one", "image": "none", "command": ["sh", "-c", f"echo one >> {trace}"]},
            {
                "name": "two",
                "image": "none",
                "command": ["sh", "-c", f"test -e {marker} || exit 1; echo two >> {trace}"],
            },
        ],
        "containers": [
            {
                "name": "main",
                "image": "none",
                "command": ["sh", "-c", f"echo main >> {trace}; exec sleep 600"],
            }
        ],
    }
    cluster.apply(_pod("ordered", spec), namespace)

    def retried() -> dict | None:
        status = _status(cluster, namespace, "ordered")
        inits = status.get("initContainerStatuses") or []
        return status if len(inits) == 2 and inits[1]["restartCount"] >= 1 else None

    status = wait_for(retried, 90, "the failing init container to be restarted")
    assert status["phase"] == "Pending"
    assert _condition(status, "Initialized") == "False"
    assert status["initContainerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"
    assert status["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"
    assert trace.read_text().split() == ["one"]

    marker.touch()

    def ready() -> dict | None:
        status = _status(cluster, namespace, "ordered")
        return status if _condition(status, "Ready") == "True" else None

    status = wait_for(ready, 120, "the pod to become Ready once its init containers succeed")
    assert _condition(status, "Initialized") == "True"
    wait_for(lambda: "main" in trace.read_text(), 30, "the main container to run")
    assert trace.read_text().split() == ["one", "two", "main"]


def test_an_init_failure_under_restart_never_fails_the_pod(cluster: ClusterHandle, namespace: str):
    manifest = textwrap.dedent("""
        apiVersion: v1
        kind: Pod
        metadata: {name: init-fails}
        spec:
          restartPolicy: Never
          automountServiceAccountToken: false
          initContainers:
          - {name: bad, image: none, command: ["sh", "-c", "exit 3"]}
          containers:
          - {name: main, image: none, command: ["sleep", "600"]}
        """)
    cluster.apply(manifest, namespace)
    status = wait_for(
        lambda: _with_phase(cluster, namespace, "init-fails", ("Failed",)), 90, "the pod to fail"
    )
    assert status["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    assert status["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"
    shown = cluster.kubectl("get", "pod", "init-fails", "-n", namespace, "--no-headers").stdout
    assert "Init:Error" in shown
