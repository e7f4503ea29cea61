"""Flotilla installed by its Helm chart on the real local cluster: the operator runs as a pod under its
ServiceAccount (in-cluster config), the webhook is on and reached through a NodePort, `helm test` gets a
completion, `helm upgrade` keeps admission, objects, engine pods and metering intact, and `helm uninstall`
removes the webhook and releases the finalizers.

One module-scoped release, uninstalled at the end (other modules run their operator as a host process).
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from pathlib import Path

import httpx
import pytest

from flotilla import contract, manifest_yaml
from flotilla.cluster.handle import ClusterHandle, wait_for
from flotilla.cluster.helm import helm
from flotilla.gateway.cmd import key_secret
from flotilla.operator.api.conditions import is_ready
from flotilla.operator.cmd.local import complete, inference_service, tiny_model
from flotilla.operator.cmd.local_chart import (
    CHART_DIR,
    NAMESPACE,
    RELEASE,
    free_node_port,
    install,
    local_values,
    operator_pods,
    uninstall,
)

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]
RUN = uuid.uuid4().hex[:5]
TENANT, NS = f"chart-{RUN}", f"chart-{RUN}"
METERING_INTERVAL = 2
WEBHOOK = "flotilla-webhook"
MODEL_DIR = Path(f"/tmp/flotilla-chart-model-{RUN}")


def _tenant(quota: int) -> str:
    spec = {"namespaces": [NS], "gpuQuota": {"h100": quota}, "pricePerGPUHour": {"h100": 2.0}}
    return manifest_yaml.dump(
        {"apiVersion": "flotilla.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": TENANT}, "spec": spec}
    )


def _isvc(name: str, replicas: int = 1) -> str:
    return manifest_yaml.dump(inference_service(name, MODEL_DIR, replicas=replicas))


def _values(node_port: int, gateway_port: int | None = None, **overrides) -> dict:
    return local_values(
        node_port,
        (MODEL_DIR,),
        gateway_port,
        operator__extraArgs=[f"--metering-interval={METERING_INTERVAL}"],
        tests__namespace=NS,
        tests__modelUri=f"file://{MODEL_DIR}",
        tests__gpuType="h100",
        tests__timeoutSeconds=300,
        **overrides,
    )


def _refused_over_quota(cluster: ClusterHandle) -> bool:
    """An over-quota dry run: True when the webhook answered with the quota message."""
    result = cluster.kubectl(
        "apply", "-n", NS, "--dry-run=server", "-f", "-", input=_isvc("too-big", 5), check=False
    )
    return result.returncode != 0 and "quota" in result.stderr and "denied the request" in result.stderr


class Release:
    def __init__(self, cluster: ClusterHandle, node_port: int, install_seconds: float, gateway_port: int):
        self.cluster, self.node_port, self.install_seconds = cluster, node_port, install_seconds
        self.gateway_port = gateway_port


@pytest.fixture(scope="module")
def release(cluster: ClusterHandle):
    tiny_model(MODEL_DIR)
    node_port = free_node_port()
    gateway_port = free_node_port()
    try:
        seconds = install(cluster, _values(node_port, gateway_port), chart=ROOT / CHART_DIR)
        print(f"helm install -> operator Ready: {seconds:.1f}s")
        yield Release(cluster, node_port, seconds, gateway_port)
    finally:
        helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", kubeconfig=cluster.kubeconfig, check=False)
        cluster.kubectl("delete", "validatingwebhookconfiguration", WEBHOOK, "--ignore-not-found")
        cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        cluster.kubectl("delete", "tenant", TENANT, "--ignore-not-found", "--wait=false", check=False)


def test_rendered_manifests_pass_the_api_servers_dry_run(cluster: ClusterHandle):
    """Every object the chart renders is valid to the real API server (schemas, CRD structure, RBAC)."""
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    # Without the `helm test` pod: admission checks that a pod's ServiceAccount exists, which its own
    # hook creates first (the real `helm test` below runs it).
    rendered = helm("template", RELEASE, str(ROOT / CHART_DIR), "--namespace", NAMESPACE).stdout
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered, check=False)
    assert result.returncode == 0, result.stderr
    assert "customresourcedefinition.apiextensions.k8s.io/inferenceservices.flotilla.dev" in result.stdout


def test_the_operator_runs_as_a_pod_under_its_service_account(release: Release, cluster: ClusterHandle):
    (pod,) = operator_pods(cluster)
    assert is_ready(pod)
    assert pod["spec"]["serviceAccountName"] == "flotilla-operator"
    # kopf peering: the operator made its meeting place itself (the chart cannot ship it beside its CRD).
    wait_for(
        lambda: cluster.kubectl("get", "clusterkopfpeering", "flotilla", check=False).returncode == 0,
        60,
        "the ClusterKopfPeering",
    )
    # It logs in with the projected token: the API server saw requests from its ServiceAccount.
    logs = cluster.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"], check=False)
    assert "Traceback" not in logs.stdout, logs.stdout[-3000:]


def test_the_webhook_refuses_over_quota_and_a_service_serves(release: Release, cluster: ClusterHandle):
    cluster.kubectl("create", "namespace", NS)
    cluster.apply(_tenant(2))
    wait_for(lambda: _refused_over_quota(cluster), 90, "the chart's webhook to refuse an over-quota service")
    cluster.apply(_isvc("svc"), namespace=NS)

    def endpoint() -> str | None:
        status = cluster.get_json("inferenceservice", "svc", "-n", NS).get("status", {})
        return (status.get("endpoints") or [None])[0] if status.get("readyReplicas") == 1 else None

    url = wait_for(endpoint, 300, "the InferenceService to be Ready")
    assert complete(url)["choices"][0]["text"] is not None


def test_the_charts_gateway_serves_the_tenant_with_its_key(release: Release, cluster: ClusterHandle):
    """The gateway pod, under its own ServiceAccount, reads the key Secret and the service, and the engine
    accepts the tenant it names (the operator and the gateway share the chart's master token)."""
    key = f"fl-{RUN}-key"
    cluster.apply(manifest_yaml.dump(key_secret(TENANT, "e2e", key, NAMESPACE, f"{TENANT}-keys")))
    gateway = f"http://127.0.0.1:{release.gateway_port}/v1/completions"
    body = {"model": "tiny", "prompt": "through the gateway", "max_tokens": 2}

    def answered() -> httpx.Response | None:
        try:
            rsp = httpx.post(gateway, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        except httpx.TransportError:
            return None
        return rsp if rsp.status_code != 401 else None  # 401 until its watch has the Secret

    rsp = wait_for(answered, 120, "the gateway to answer with the tenant's key")
    assert rsp.status_code == 200, rsp.text
    # Through Envoy: the Service's http port is Envoy's, which names itself in the response.
    assert rsp.headers.get("server") == "envoy", rsp.headers
    refused = httpx.post(gateway, json=body, timeout=30)
    assert refused.status_code == 401 and refused.headers.get("server") == "envoy"
    secret = cluster.get_json("secret", "flotilla-engine-token", "-n", NS)
    assert secret["data"]["token"]  # the operator derived the namespace's engine token
    _envoys_stats_count_the_requests(cluster)


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of the one sample `name{labels...}` in Prometheus text (labels in any order)."""
    found = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line.split("}")[0] for k, v in labels.items())
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def _envoys_stats_count_the_requests(cluster: ClusterHandle) -> None:
    """Envoy's stats port on the gateway pod's IP (what Prometheus's flotilla-envoy job scrapes) counts the
    requests just sent; the rest of the admin is not there."""
    pods = cluster.get_json("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=flotilla-gateway")["items"]
    (pod,) = [p for p in pods if is_ready(p)]
    envoy = next(c for c in pod["spec"]["initContainers"] if c["name"] == "envoy")
    port = next(p["containerPort"] for p in envoy["ports"] if p["name"] == contract.ENVOY_STATS_PORT_NAME)
    stats = f"http://{pod['status']['podIP']}:{port}"
    text = httpx.get(stats + contract.ENVOY_STATS_PATH, timeout=10, trust_env=False).text
    clients = {contract.LABEL_ENVOY_PREFIX: contract.ENVOY_CLIENTS_PREFIX}
    assert _sample(text, contract.ENVOY_DOWNSTREAM_RQ, **clients) >= 2  # the completion and the refusal
    assert (
        _sample(text, contract.ENVOY_DOWNSTREAM_RQ_XX, **clients, **{contract.LABEL_ENVOY_CODE_CLASS: "2"})
        >= 1
    )
    assert (
        _sample(text, contract.ENVOY_DOWNSTREAM_RQ_XX, **clients, **{contract.LABEL_ENVOY_CODE_CLASS: "4"})
        >= 1
    )
    assert _sample(text, "envoy_http_ext_proc_streams_started", **clients) >= 2  # each asked the picker
    # The engines Envoy knows, from the picker's EDS: the service's replica.
    assert _sample(text, contract.ENVOY_MEMBERSHIP_TOTAL,
                   **{contract.LABEL_ENVOY_CLUSTER: contract.ENVOY_ENGINES_CLUSTER}) >= 1  # fmt: skip
    for method, path in (("POST", "/quitquitquit"), ("GET", "/config_dump"), ("POST", "/drain_listeners")):
        assert httpx.request(method, stats + path, timeout=10, trust_env=False).status_code == 404
    assert httpx.get(stats + "/ready", timeout=10, trust_env=False).text.strip() == "LIVE"


def test_helm_test_gets_a_completion(release: Release, cluster: ClusterHandle):
    result = helm(
        "test", RELEASE, "-n", NAMESPACE, "--timeout", "8m", kubeconfig=cluster.kubeconfig, check=False
    )
    # The node agent serves no kubelet API (no `kubectl logs`): its log files are the container's output.
    logs = "".join(
        path.read_text()
        for path in (cluster.config.state_dir / "pods" / "logs").glob(
            f"{NS}_{RELEASE}-test-completion*/*.log"
        )
    )
    assert result.returncode == 0, result.stdout + result.stderr + logs
    assert "completion from" in logs
    # The test's own service is gone again, so the quota is back.
    wait_for(
        lambda: (
            cluster.kubectl("get", "inferenceservice", "flotilla-helm-test", "-n", NS, check=False).returncode
            != 0
        ),
        60,
        "the helm test's InferenceService to be deleted",
    )


def _gpu_seconds(cluster: ClusterHandle) -> tuple[float, str]:
    status = cluster.get_json("tenant", TENANT).get("status", {})
    return float(((status.get("usage") or {}).get("total") or {}).get("total", 0.0)), status.get(
        "lastMeteredTime", ""
    )


def _time(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _metered_after(cluster: ClusterHandle, since: str) -> tuple[float, str] | None:
    total, when = _gpu_seconds(cluster)
    return (total, when) if when and (not since or _time(when) > _time(since)) else None


def _wait_metered(cluster: ClusterHandle, since: str) -> tuple[float, str]:
    found = wait_for(lambda: _metered_after(cluster, since), 60, f"a metering round after {since}")
    assert found is not None
    return found


def test_upgrade_keeps_the_webhook_objects_engine_pods_and_metering(release: Release, cluster: ClusterHandle):
    ca_before = cluster.get_json("validatingwebhookconfiguration", WEBHOOK)["webhooks"][0]["clientConfig"][
        "caBundle"
    ]
    (old_operator,) = operator_pods(cluster)
    engines = cluster.get_json("pods", "-n", NS, "-l", "flotilla.dev/inferenceservice=svc")["items"]
    assert len(engines) == 1
    engine_uid = engines[0]["metadata"]["uid"]
    # Only this service holds a GPU from here on (the helm test's pod is gone): meter a round after now.
    wait_for(
        lambda: len(cluster.get_json("pods", "-n", NS, "-l", "flotilla.dev/inferenceservice")["items"]) == 1,
        120,
        "only the service's engine pod in " + NS,
    )
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    total_before, metered_before = _wait_metered(cluster, now)

    # Admission is asked over and over while the upgrade replaces the operator pod: every answer must be
    # the webhook's refusal, never a failure to call it.
    failures: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            result = cluster.kubectl(
                "apply", "-n", NS, "--dry-run=server", "-f", "-", input=_isvc("too-big", 5), check=False
            )
            if "denied the request" not in result.stderr:
                failures.append(result.stderr.strip())

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        install(cluster, _values(release.node_port, operator__verbose=True), chart=ROOT / CHART_DIR)
        wait_for(
            lambda: (
                [
                    p
                    for p in operator_pods(cluster)
                    if p["metadata"]["uid"] != old_operator["metadata"]["uid"] and is_ready(p)
                ]
                and len(operator_pods(cluster)) == 1
            ),
            120,
            "the old operator pod to be replaced by a Ready new one",
        )
    finally:
        stop.set()
        prober.join(timeout=120)
    assert not failures, failures[:3]

    webhook = cluster.get_json("validatingwebhookconfiguration", WEBHOOK)
    assert webhook["webhooks"][0]["clientConfig"]["caBundle"] == ca_before
    engines = cluster.get_json("pods", "-n", NS, "-l", "flotilla.dev/inferenceservice=svc")["items"]
    assert [p["metadata"]["uid"] for p in engines] == [engine_uid]
    assert engines[0]["status"]["containerStatuses"][0]["restartCount"] == 0
    assert cluster.get_json("tenant", TENANT)["metadata"]["name"] == TENANT

    # Metering across the replacement: the new operator meters on from lastMeteredTime, so what was
    # added since the last round before the upgrade is the one GPU held over that span, no more, no less.
    _, now_metered = _gpu_seconds(cluster)
    total, when = _wait_metered(cluster, now_metered)
    span = (_time(when) - _time(metered_before)).total_seconds()
    assert span > 0
    # Allow 2 s for the pod's phase changes being seen late; a lost or doubled round is a whole span off.
    assert abs((total - total_before) - span) <= 2, (total - total_before, span)


def test_uninstall_removes_the_webhook_and_releases_finalizers(release: Release, cluster: ClusterHandle):
    # kopf's finalizer sits on every object a daemon runs for: each Tenant (metering).
    assert "flotilla.dev/finalizer" in (
        cluster.get_json("tenant", TENANT)["metadata"].get("finalizers") or []
    )
    uninstall(cluster)
    assert cluster.kubectl("get", "validatingwebhookconfiguration", WEBHOOK, check=False).returncode != 0
    assert (
        cluster.kubectl("get", "deployment", "flotilla-operator", "-n", NAMESPACE, check=False).returncode
        != 0
    )
    # The CRDs stay, with the tenants' objects; the operator's finalizer is gone from them.
    assert cluster.kubectl("get", "crd", "inferenceservices.flotilla.dev", check=False).returncode == 0
    # The engine pods run on, released from the metering finalizer that only an operator would remove.
    engines = cluster.get_json("pods", "-n", NS, "-l", "flotilla.dev/inferenceservice=svc")["items"]
    assert engines and all(
        "flotilla.dev/metering" not in (p["metadata"].get("finalizers") or []) for p in engines
    ), [p["metadata"].get("finalizers") for p in engines]
    cluster.kubectl("delete", "pods", "-n", NS, "-l", "flotilla.dev/inferenceservice=svc", "--timeout=60s")
    tenant = cluster.get_json("tenant", TENANT)
    assert "flotilla.dev/finalizer" not in (tenant["metadata"].get("finalizers") or [])
    assert cluster.get_json("inferenceservice", "svc", "-n", NS)["metadata"]["name"] == "svc"
    # With no operator and no webhook, deletes complete instead of waiting on a finalizer.
    cluster.kubectl("delete", "inferenceservice", "svc", "-n", NS, "--timeout=60s")
    cluster.kubectl("delete", "tenant", TENANT, "--timeout=60s")
