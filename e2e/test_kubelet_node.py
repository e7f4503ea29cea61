"""A cluster whose node is a real kubelet on containerd and runc (flotilla.cluster.node_machine), and the
chart installed on it with its defaults (webhook on), its pods running from the images `flotilla images
build` makes: what the node agent only pretended, attacked here for real.

- the node is a kubelet of the pinned release on containerd, with 8 fake GPUs its device plugin advertised
  over the kubelet's device-plugin gRPC API;
- the operator and gateway pods (Envoy beside the gateway) run from the built images, pulled from nowhere;
- the webhook in the operator's pod refuses an over-quota InferenceService (the API server reaches the pod
  through its Service);
- the kubelet enforces what the pods declare: the image's non-root uid, a read-only root, the memory limit
  as a cgroup;
- GPUs are counted and assigned by the kubelet: a pod gets NVIDIA_VISIBLE_DEVICES naming its devices, and
  a pod asking for more than are left stays Pending;
- three gateway pods of the chart (`gateway.replicas: 3`, `gateway.rateLimitRedis`: Debian's redis-server on
  the host's bridge address) admit what one would of a tenant's requests (issue 51);
- real faults: a container SIGKILLed is restarted by the kubelet (exit 137, a new container, the webhook
  answers again); the kubelet and containerd SIGKILLed come back, and every container they left running is
  adopted, none restarted.

- an engine pod from the engine image (CUDA torch, about 6 GB, on the CPU here) serves a completion through
  the chart's Envoy and picker with the tenant's key;
- two tenants' LoRA adapters on a shared Tenant's base service, through the chart (issue 51): each key
  reaches its own, not the other's, and a base in another tenant's namespace is refused at create;
- a pod in a tenant's namespace, and one in a namespace of no tenant, reach an engine pod but can neither
  load an adapter into it nor pass as another tenant (issue 51).

The other e2e tests still run engine pods on the node agent's nodes (docs/local-cluster.md)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from flotilla import contract, manifest_yaml, timestamps
from flotilla.cluster import node_host, node_images
from flotilla.cluster.control_plane import ClusterConfig, down, up
from flotilla.cluster.handle import ClusterHandle, free_port, wait_for
from flotilla.cluster.node_layout import host_ip
from flotilla.cluster.paths import default_state_dir
from flotilla.cluster.processes import ProcessTable
from flotilla.gateway.cmd import key_secret
from flotilla.images.envoy import envoy_image
from flotilla.operator.api.conditions import is_ready
from flotilla.operator.cmd.local import inference_service, tiny_model
from flotilla.operator.cmd.local_chart import CHART_DIR, NAMESPACE, install, operator_pods

pytestmark = [pytest.mark.cluster, pytest.mark.images]

ROOT = Path(__file__).resolve().parents[1]
POD_IP_BASE = 9  # the suite's other cluster uses 7, the demo's 1
RUN = uuid.uuid4().hex[:5]
TENANT = NS = f"kn-{RUN}"
GPU_NS = f"kn-gpus-{RUN}"  # no Tenant's: its ResourceQuota (the operator's backstop) would cap the GPUs
SHARED_NS, NS_A, NS_B = f"kns-{RUN}", f"kna-{RUN}", f"knb-{RUN}"  # a shared Tenant's and two tenants'
SERVED = f"base-{RUN}"  # the shared base's served name
METERING = "--metering-interval=2"  # the operator's metering rounds, in seconds (its default is 10)
IMAGES = (contract.OPERATOR_IMAGE, contract.GATEWAY_IMAGE)
# The one host-path root tenants may use (operator.hostPathRoots): the model and the LoRA adapters. Not
# pytest's tmp_path: its parent is 0700, and the engine image's user (65532) must reach the files.
WORK = Path(f"/tmp/flotilla-kubelet-node-{RUN}")
MODEL_DIR, ADAPTERS = WORK / "model", WORK / "adapters"


@pytest.fixture(scope="module")
def node_cluster(built_images: str, built_engine_image: str):
    """A cluster with one kubelet node and no node agent, the images built (the root conftest's fixtures,
    shared with tests/images) and loaded into the node's containerd; purged afterwards."""
    del built_images, built_engine_image
    state_dir = default_state_dir().parent / "test-kubelet-node"
    down(state_dir, purge=True)
    config = ClusterConfig(
        state_dir=state_dir,
        apiserver_port=free_port(),
        etcd_port=free_port(),
        pod_ip_base=POD_IP_BASE,
        nodes=0,
        kubelet_nodes=1,
    )
    config.etcd_peer_port = free_port()
    try:
        handle = ClusterHandle(up(config), started_here=True)
        (layout,) = config.node_layouts()
        for image in (*IMAGES, envoy_image(), contract.ENGINE_IMAGE):
            seconds = node_images.load_image(ProcessTable(state_dir / "pids"), layout, image)
            print(f"loaded {image} into {layout.name} in {seconds:.0f}s", flush=True)
        wait_for(
            lambda: _node(handle) is not None and _ready(_node(handle)), 180, "the kubelet's node to be Ready"
        )
        yield handle
    finally:
        down(state_dir, purge=True)
        shutil.rmtree(WORK, ignore_errors=True)


def _node(cluster: ClusterHandle) -> dict | None:
    items = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    return items[0] if items else None


def _ready(obj: dict | None) -> bool:
    conditions = (obj or {}).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


@pytest.fixture(scope="module")
def chart(node_cluster: ClusterHandle):
    """The chart with its defaults, but for the one folder tenants may serve models from."""
    tiny_model(MODEL_DIR)
    values = {"operator": {"hostPathRoots": [str(WORK)], "extraArgs": [METERING]}}
    seconds = install(node_cluster, values, chart=ROOT / CHART_DIR, timeout="8m")
    print(f"helm install (defaults) -> every pod Ready on the kubelet node: {seconds:.1f}s")
    return node_cluster


def _pods(cluster: ClusterHandle, namespace: str) -> list[dict]:
    return json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]


def test_the_node_is_a_kubelet_on_containerd_with_gpus_from_its_device_plugin(node_cluster: ClusterHandle):
    node = _node(node_cluster)
    assert node is not None
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.36.3"
    assert info["containerRuntimeVersion"].startswith("containerd://")
    # Extended resources appear only once a device plugin registered them with the kubelet.
    wait_for(
        lambda: (
            (_node(node_cluster) or {}).get("status", {}).get("allocatable", {}).get(contract.GPU_RESOURCE)
            == "8"
        ),
        60,
        "the device plugin's 8 GPUs in the node's allocatable",
    )
    assert node["metadata"]["labels"][contract.GPU_TYPE_LABEL] == "h100"


def test_the_charts_pods_run_from_the_built_images(chart: ClusterHandle):
    built = {image: node_images.image_id(image) for image in (*IMAGES, envoy_image())}
    seen: dict[str, str] = {}
    for pod in _pods(chart, NAMESPACE):
        statuses = pod["status"].get("containerStatuses", []) + pod["status"].get("initContainerStatuses", [])
        for status in statuses:
            seen[status["image"]] = status["imageID"]
    for image, image_id in built.items():
        assert image in seen, f"no container runs {image}: {sorted(seen)}"
        assert seen[image].endswith(image_id), (image, seen[image], image_id)


def test_the_webhook_in_its_pod_refuses_an_inference_service_over_quota(chart: ClusterHandle):
    tenant = {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": TENANT},
        "spec": {"namespaces": [NS], "gpuQuota": {"h100": 1}},
    }
    chart.kubectl("create", "namespace", NS)
    chart.kubectl("apply", "-f", "-", input=manifest_yaml.dump(tenant))
    service = inference_service("too-big", "hf://org/model", namespace=NS, replicas=5)

    def refused() -> str | None:
        done = chart.kubectl(
            "apply", "--dry-run=server", "-f", "-", input=manifest_yaml.dump(service), check=False
        )
        return done.stderr if done.returncode != 0 and "denied the request" in done.stderr else None

    message = wait_for(refused, 60, "the webhook to refuse the over-quota InferenceService")
    assert "quota" in message


def test_the_kubelet_enforces_the_operators_user_read_only_root_and_memory_limit(chart: ClusterHandle):
    (pod,) = operator_pods(chart)
    script = (
        "import os\n"
        "print('uid', os.getuid())\n"
        "try:\n    open('/written-by-a-test', 'w')\nexcept OSError as exc:\n    print('write', exc.errno)\n"
        "print('limit', open('/sys/fs/cgroup/memory/memory.limit_in_bytes').read().strip())\n"
    )
    out = chart.kubectl("exec", "-n", NAMESPACE, pod["metadata"]["name"], "--", "python", "-c", script).stdout
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    assert lines["uid"] == str(contract.IMAGE_UID)
    assert lines["write"] == "30"  # EROFS: the root filesystem is read-only
    limit = pod["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert limit == "1Gi" and int(lines["limit"]) == 1024**3


def _gpu_pod(name: str, gpus: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": GPU_NS},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": contract.OPERATOR_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", "echo visible=$NVIDIA_VISIBLE_DEVICES; sleep 600"],
                    "resources": {"limits": {contract.GPU_RESOURCE: str(gpus)}},
                }
            ],
        },
    }


def test_the_kubelet_assigns_gpus_and_refuses_more_than_are_left(chart: ClusterHandle):
    chart.kubectl("create", "namespace", GPU_NS)
    chart.kubectl("apply", "-f", "-", input=manifest_yaml.dump(_gpu_pod("two-gpus", 2)))

    def visible() -> list[str] | None:
        done = chart.kubectl("logs", "-n", GPU_NS, "two-gpus", check=False)
        for line in done.stdout.splitlines():
            if line.startswith("visible="):
                return line.removeprefix("visible=").split(",")
        return None

    devices = wait_for(visible, 120, "the GPU pod to print its devices")
    assert len(devices) == 2 and len(set(devices)) == 2
    assert all(d.startswith("GPU-node-0-") for d in devices)

    chart.kubectl("apply", "-f", "-", input=manifest_yaml.dump(_gpu_pod("seven-gpus", 7)))

    def unschedulable() -> str | None:
        pod = json.loads(chart.kubectl("get", "pod", "-n", GPU_NS, "seven-gpus", "-o", "json").stdout)
        for condition in pod["status"].get("conditions", []):
            if condition["type"] == "PodScheduled" and condition.get("reason") == "Unschedulable":
                return condition.get("message", "")
        return None

    message = wait_for(unschedulable, 60, "the 7-GPU pod to be refused by the scheduler")
    assert f"Insufficient {contract.GPU_RESOURCE}" in message


def test_an_engine_pod_from_the_engine_image_serves_through_the_charts_gateway(chart: ClusterHandle):
    """The whole path on real parts: the tenant's key at the chart's Envoy (its stand-in image), the picker
    in the gateway pod, an engine pod the operator made from the engine image, on the kubelet, with a GPU
    the device plugin gave it, reading a model folder the kubelet mounted from the node."""
    chart.kubectl("create", "namespace", NS, check=False)
    service = inference_service("tiny", MODEL_DIR, namespace=NS)
    chart.apply_once_admitted(manifest_yaml.dump(service), 60, "the webhook to admit the InferenceService")
    key = f"fl-{RUN}-serve"
    secret = key_secret(TENANT, "serve", key, NAMESPACE, f"{TENANT}-serve-keys")
    chart.kubectl("apply", "-f", "-", input=manifest_yaml.dump(secret))

    def ready() -> dict | None:
        found = json.loads(chart.kubectl("get", "inferenceservice", "tiny", "-n", NS, "-o", "json").stdout)
        return found if is_ready(found) else None

    wait_for(ready, 300, "the engine pod to load the model and the InferenceService to be Ready")
    (engine,) = [p for p in _pods(chart, NS) if not p["metadata"].get("deletionTimestamp")]
    (status,) = engine["status"]["containerStatuses"]
    assert status["image"] == contract.ENGINE_IMAGE
    assert status["imageID"].endswith(node_images.image_id(contract.ENGINE_IMAGE))
    gateway = next(
        p
        for p in _pods(chart, NAMESPACE)
        if p["metadata"]["labels"].get("app.kubernetes.io/name") == "flotilla-gateway"
    )
    url = f"http://{gateway['status']['podIP']}:8081/v1/completions"
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}

    def answered() -> httpx.Response | None:
        rsp = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        return None if rsp.status_code in (401, 404) else rsp  # until the gateway's watches have both

    rsp = wait_for(answered, 120, "the gateway to serve the tenant's completion")
    assert rsp.status_code == 200, rsp.text
    assert rsp.json()["usage"]["completion_tokens"] == 4
    assert rsp.headers.get("server") == "envoy"


ENVOY_PORT = 8081  # the chart's gateway.envoy.port


def _gateway_url(cluster: ClusterHandle) -> str:
    pods = [
        p
        for p in _pods(cluster, NAMESPACE)
        if p["metadata"]["labels"].get("app.kubernetes.io/name") == "flotilla-gateway"
    ]
    ready = [p for p in pods if not p["metadata"].get("deletionTimestamp") and p["status"].get("podIP")]
    return f"http://{ready[0]['status']['podIP']}:{ENVOY_PORT}/v1"


def _post(cluster: ClusterHandle, model: str, key: str, timeout: float = 120) -> httpx.Response:
    body = {"model": model, "prompt": "Hello", "max_tokens": 4}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{_gateway_url(cluster)}/completions", json=body, headers=headers, timeout=timeout)


def _answered(cluster: ClusterHandle, model: str, key: str) -> httpx.Response | None:
    rsp = _post(cluster, model, key)
    return (
        None if rsp.status_code in (401, 404) else rsp
    )  # until the gateway's watches have the key and model


def _tenant(name: str, namespace: str, **spec) -> dict:
    return {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": name},
        "spec": {"namespaces": [namespace], "gpuQuota": {"h100": 2}, **spec},
    }


def _adapter(name: str, namespace: str, folder: Path, base_ns: str) -> dict:
    return {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"inferenceService": "base", "serviceNamespace": base_ns, "source": f"file://{folder}"},
    }


def _loaded_pods(cluster: ClusterHandle, namespace: str) -> list[str]:
    found = json.loads(cluster.kubectl("get", "loraadapter", "sql", "-n", namespace, "-o", "json").stdout)
    return [r["pod"] for r in (found.get("status") or {}).get("replicas") or [] if r["phase"] == "Loaded"]


def _tenant_status(cluster: ClusterHandle, name: str) -> dict:
    return json.loads(cluster.kubectl("get", "tenant", name, "-o", "json").stdout).get("status") or {}


def _models(cluster: ClusterHandle, key: str) -> dict[str, dict]:
    rsp = httpx.get(f"{_gateway_url(cluster)}/models", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    return {m["id"]: m for m in rsp.json()["data"]}


def test_two_tenants_adapters_on_a_shared_base_through_the_chart(chart: ClusterHandle):
    """Issue 51 through the installed chart (webhook on), every pod from the built images on the kubelet:
    a shared Tenant's base service with LoRA (`spec.shared: true`: its services every tenant's, its GPU time
    its own), each tenant's adapter `sql` on it (spec.serviceNamespace). Each key reaches its own adapter,
    404 for the other's as for an unknown name, 401 without a key, and lists only its own in /v1/models;
    an adapter naming a base in another tenant's namespace is refused at create; each Tenant meters its own
    adapter's tokens, the shared Tenant the base's GPU time; the engine pod killed, a request waits for the
    new replica to have the adapter loaded, then is served."""
    from flotilla.bench.engine.lora import write_random_adapter
    from flotilla.engine.model.config import ModelConfig

    for seed, name in enumerate(("sql-a", "sql-b")):
        write_random_adapter(
            ADAPTERS / name, ModelConfig.from_file(MODEL_DIR / "config.json"), rank=8, seed=seed
        )
    key_a, key_b = f"fl-a-{uuid.uuid4().hex}", f"fl-b-{uuid.uuid4().hex}"
    for ns in (SHARED_NS, NS_A, NS_B):
        chart.kubectl("create", "namespace", ns)
    lora = {"enabled": True, "maxLoras": 2, "maxLoraRank": 16, "adapterDir": str(ADAPTERS)}
    engine = {"kvCacheMemory": "64Mi", "maxNumSeqs": 4, "lora": lora}
    docs = [
        _tenant(SHARED_NS, SHARED_NS, shared=True),  # sharing is granted, not implied by no claim
        _tenant(NS_A, NS_A),
        _tenant(NS_B, NS_B),
        key_secret(NS_A, "first", key_a, NAMESPACE, f"{NS_A}-keys"),
        key_secret(NS_B, "first", key_b, NAMESPACE, f"{NS_B}-keys"),
        inference_service("base", MODEL_DIR, SHARED_NS, served_name=SERVED, engine=engine),
        _adapter("sql", NS_A, ADAPTERS / "sql-a", SHARED_NS),
        _adapter("sql", NS_B, ADAPTERS / "sql-b", SHARED_NS),
    ]
    chart.apply_once_admitted(manifest_yaml.dump_all(docs), 60, "the shared base and both adapters admitted")
    loaded: dict[str, list[str]] = {}
    for ns in (NS_A, NS_B):
        loaded[ns] = wait_for(
            lambda ns=ns: _loaded_pods(chart, ns) or [], 300, f"{ns}/sql loaded into the base's pod"
        )
    (pod,) = loaded[NS_A]
    assert loaded[NS_B] == [pod]  # one replica, of the shared base

    generated = {NS_A: 0, NS_B: 0}
    for key, ns in ((key_a, NS_A), (key_b, NS_B)):
        first = wait_for(
            lambda key=key: _answered(chart, "sql", key), 120, f"{ns}'s key to reach its adapter"
        )
        for answer in (first, _post(chart, f"{ns}/sql", key)):
            assert answer.status_code == 200 and answer.json()["model"] == f"{ns}/sql", answer.text
            generated[ns] += answer.json()["usage"]["completion_tokens"]
    base = _post(chart, SERVED, key_a)  # the shared base itself: every tenant's
    assert base.status_code == 200 and base.json()["model"] == SERVED, base.text
    for model, key in ((f"{NS_B}/sql", key_a), (f"{NS_A}/sql", key_b), (f"{NS_A}/stolen", key_b)):
        refused = _post(chart, model, key)
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["message"] == f"the model {model!r} does not exist"
    assert _post(chart, "sql", "fl-not-a-key").status_code == 401
    mine, theirs = _models(chart, key_a), _models(chart, key_b)
    assert mine["sql"]["parent"] == SERVED and theirs["sql"]["parent"] == SERVED
    assert f"{NS_B}/sql" not in mine and f"{NS_A}/sql" not in theirs

    stolen = manifest_yaml.dump(_adapter("stolen", NS_A, Path("/nowhere"), base_ns=NS_B))
    refused = chart.kubectl("apply", "-f", "-", input=stolen, check=False)
    assert refused.returncode != 0 and "spec.serviceNamespace" in refused.stderr and NS_B in refused.stderr, (
        refused.stderr
    )

    # Metering: each tenant's status counts its own adapter's tokens, never the other's.
    for tenant, other in ((NS_A, NS_B), (NS_B, NS_A)):

        def metered(tenant: str = tenant) -> dict | None:
            adapters = _tenant_status(chart, tenant).get("adapters") or {}
            return (
                adapters
                if (adapters.get(f"{tenant}/sql") or {}).get("output", 0) >= generated[tenant]
                else None
            )

        usage = wait_for(metered, 120, f"{tenant}'s metering of {tenant}/sql")
        assert f"{other}/sql" not in usage and usage[f"{tenant}/sql"]["output"] == generated[tenant], usage
    seconds = wait_for(
        lambda: (
            (_tenant_status(chart, SHARED_NS).get("usage") or {}).get("total", {}).get("byNamespace", {})
        ).get(SHARED_NS),
        120,
        "the shared Tenant's metering of the base's GPU time",
    )
    assert seconds > 0

    # The engine pod killed: each request waits for the new replica to have its adapter, then is served.
    chart.kubectl("delete", "pod", pod, "-n", SHARED_NS, "--wait=false")
    for key, ns in ((key_a, NS_A), (key_b, NS_B)):
        after = _post(chart, "sql", key, timeout=300)
        assert after.status_code == 200 and after.json()["model"] == f"{ns}/sql", after.text
    for ns in (NS_A, NS_B):
        assert pod not in _loaded_pods(chart, ns)


ATTACK = """
import json, sys, urllib.error, urllib.request
base, served, other = sys.argv[1:4]
def call(path, body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as rsp:
            return [rsp.status, ""]
    except urllib.error.HTTPError as err:
        return [err.code, json.loads(err.read() or b"{}").get("error", {}).get("code", "")]
print(json.dumps({
    "health": call("/health"),
    "load": call("/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": "/tmp"}),
    "as_other": call("/v1/completions", {"model": served, "prompt": "x", "max_tokens": 1}, {"X-Flotilla-Tenant": other}),
}))
"""


def _attacker(cluster: ClusterHandle, namespace: str) -> str:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "attacker", "namespace": namespace},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": contract.OPERATOR_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "600"],
                }
            ]
        },
    }
    cluster.kubectl("apply", "-f", "-", input=manifest_yaml.dump(pod))

    def running() -> bool:
        found = json.loads(cluster.kubectl("get", "pod", "attacker", "-n", namespace, "-o", "json").stdout)
        return found["status"].get("phase") == "Running"

    wait_for(running, 120, f"the attacker pod in {namespace} to run")
    return "attacker"


def test_a_pod_in_a_tenants_namespace_or_another_gets_nothing_from_an_engine(chart: ClusterHandle):
    """Issue 51, item 2, from inside the pod network: a pod in tenant A's own namespace and one in a
    namespace of no tenant reach the shared base's engine pod (its /health answers), but can neither load
    an adapter (no operator token) nor pass as tenant B (no gateway credential)."""
    (engine,) = [p for p in _pods(chart, SHARED_NS) if not p["metadata"].get("deletionTimestamp")]
    url = f"http://{engine['status']['podIP']}:8000"
    stranger = f"kn-stranger-{RUN}"
    chart.kubectl("create", "namespace", stranger)
    for namespace in (NS_A, stranger):
        pod = _attacker(chart, namespace)
        out = chart.kubectl(
            "exec", "-n", namespace, pod, "--", "python", "-c", ATTACK, url, SERVED, NS_B
        ).stdout
        got = json.loads(out)
        assert got["health"] == [200, ""], (namespace, got)
        assert got["load"] == [403, "internal_token_required"], (namespace, got)
        assert got["as_other"] == [403, "tenant_not_allowed"], (namespace, got)


def _layout(cluster: ClusterHandle):
    return cluster.config.node_layouts()[0]


def _table(cluster: ClusterHandle) -> ProcessTable:
    return ProcessTable(cluster.config.state_dir / "pids")


def _containers(cluster: ClusterHandle) -> dict[str, tuple[str, int]]:
    """container name in its pod -> (container id, restart count), for the chart's pods."""
    found = {}
    for pod in _pods(cluster, NAMESPACE):
        for status in pod["status"].get("containerStatuses", []) + pod["status"].get(
            "initContainerStatuses", []
        ):
            if status.get("containerID") and status.get("started", True):
                found[f"{pod['metadata']['name']}/{status['name']}"] = (
                    status["containerID"],
                    status["restartCount"],
                )
    return found


def test_a_killed_container_is_restarted_by_the_kubelet_and_the_webhook_answers_again(chart: ClusterHandle):
    (pod,) = operator_pods(chart)
    (status,) = pod["status"]["containerStatuses"]
    container_id = status["containerID"].removeprefix("containerd://")
    node_host.kill_container(_table(chart), _layout(chart), container_id)

    def restarted() -> dict | None:
        (now,) = operator_pods(chart)
        (current,) = now["status"]["containerStatuses"]
        return current if current["restartCount"] > status["restartCount"] and current.get("ready") else None

    current = wait_for(restarted, 180, "the kubelet to restart the killed operator container")
    assert current["containerID"] != status["containerID"]
    assert "lastState" in current and current["lastState"].get("terminated", {}).get("exitCode") == 137
    service = inference_service("too-big-again", "hf://org/model", namespace=NS, replicas=5)

    def refused() -> bool:
        done = chart.kubectl(
            "apply", "--dry-run=server", "-f", "-", input=manifest_yaml.dump(service), check=False
        )
        return done.returncode != 0 and "quota" in done.stderr

    wait_for(refused, 120, "the restarted operator's webhook to refuse the over-quota InferenceService")


def test_the_kubelet_and_containerd_killed_come_back_and_leave_every_container_running(chart: ClusterHandle):
    layout, before = _layout(chart), _containers(chart)
    assert before
    for daemon in ("containerd", "kubelet"):
        pid = node_host.daemon_pid(layout, daemon)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda daemon=daemon, pid=pid: node_host.daemon_pid(layout, daemon) not in (None, pid),
            60,
            f"the node to start {daemon} again",
        )
    killed_at = time.time()

    def heartbeat_after_restart() -> bool:
        lease = json.loads(
            chart.kubectl("get", "lease", "-n", "kube-node-lease", layout.name, "-o", "json").stdout
        )
        renewed = lease["spec"]["renewTime"]
        return _ready(_node(chart)) and timestamps.parse_time(renewed).timestamp() > killed_at

    wait_for(heartbeat_after_restart, 120, "the restarted kubelet to renew the node's lease")
    # The restarted kubelet adopts what containerd's shims kept running: nothing restarted, nothing new.
    assert _containers(chart) == before


@pytest.fixture
def redis_on_the_bridge():
    """Debian's redis-server on the host's bridge address, where the node's pods reach it."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is missing: `make install` installs Debian's redis-server"
    host, port = host_ip(POD_IP_BASE), free_port()
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        host,
        "--protected-mode",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"redis://{host}:{port}/0"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_three_gateway_pods_of_the_chart_admit_what_one_would(chart: ClusterHandle, redis_on_the_bridge: str):
    """A tenant with a one-request burst (one more in 1,000 s): over the chart's three gateway pods sharing
    Redis, exactly one request is admitted (held, then 503: no engine runs here) and every other is a 429,
    whichever pod it reaches; each replica alone would have admitted one."""
    values = {
        "operator": {"hostPathRoots": [str(WORK)], "extraArgs": [METERING]},
        "gateway": {"replicas": 3, "rateLimitRedis": redis_on_the_bridge, "holdTimeoutSeconds": 2},
    }
    install(chart, values, chart=ROOT / CHART_DIR, timeout="8m")
    chart.kubectl("create", "namespace", NS, check=False)
    tenant = {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": TENANT},
        "spec": {"namespaces": [NS], "gpuQuota": {"h100": 2}, "rateLimits": {"requestsPerSecond": 0.001}},
    }
    chart.kubectl("apply", "-f", "-", input=manifest_yaml.dump(tenant))
    chart.kubectl(
        "apply",
        "-f",
        "-",
        input=manifest_yaml.dump(inference_service("limited", "hf://org/m", NS, served_name="limited")),
    )
    key = f"fl-{RUN}-limits"
    chart.kubectl(
        "apply",
        "-f",
        "-",
        input=manifest_yaml.dump(key_secret(TENANT, "e2e", key, NAMESPACE, f"{TENANT}-keys")),
    )
    pods = [
        p
        for p in _pods(chart, NAMESPACE)
        if p["metadata"]["labels"].get("app.kubernetes.io/name") == "flotilla-gateway"
        and not p["metadata"].get("deletionTimestamp")
    ]
    assert len(pods) == 3, [p["metadata"]["name"] for p in pods]
    body = {"model": "limited", "prompt": "limited", "max_tokens": 1}
    codes: list[int] = []
    for pod in pods:
        url = f"http://{pod['status']['podIP']}:{ENVOY_PORT}/v1/completions"

        def post(url: str = url) -> int:
            return httpx.post(
                url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
            ).status_code

        def first(post=post) -> int | None:
            # 401 until this pod's watch has the key, 404 until it has the service: neither takes from a bucket.
            code = post()
            return None if code in (401, 404) else code

        codes.append(wait_for(first, 120, "the gateway pod to know the key and the service"))
        codes += [post() for _ in range(3)]
    print(f"the tenant's 12 requests over 3 gateway pods sharing Redis: {codes}")
    assert len(codes) == 12
    assert sum(code != 429 for code in codes) == 1, codes
