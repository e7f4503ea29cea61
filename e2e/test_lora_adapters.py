"""LoRAAdapters on the real local cluster: the operator (under its least-privilege ServiceAccount) loads an
adapter into the ready replica of its base InferenceService (the real engine, CPU, a random-weight tiny
model), the replica serves `model: <adapter>`, a replica that replaces a deleted pod gets the adapter
again, so does an engine that lost it while the operator was down, and deleting the adapter unloads it. A
source no engine can load is refused in status; an http(s) archive source is fetched by the replica's
engine itself."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from flotilla.cluster.handle import ClusterHandle, wait_for
from flotilla.operator.cmd.local import (
    OperatorProcess,
    complete,
    inference_service,
    install_manifests,
    service_account_kubeconfig,
    tiny_model,
)

pytestmark = pytest.mark.cluster

BASE = "base"
ADAPTER = "sql"


@pytest.fixture(scope="module")
def operator(cluster: ClusterHandle, tmp_path_factory) -> Iterator[OperatorProcess]:
    install_manifests(cluster)
    workdir = tmp_path_factory.mktemp("operator")
    kubeconfig = service_account_kubeconfig(cluster, workdir / "operator.kubeconfig")
    proc = OperatorProcess(kubeconfig, workdir / "operator.log")
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama: Path, tmp_path_factory) -> Path:
    """A PEFT folder of rank 8 on every decoder linear layer of the tiny model (no PEFT needed)."""
    from flotilla.bench.engine.lora import write_random_adapter
    from flotilla.engine.model.config import ModelConfig

    folder = tmp_path_factory.mktemp("adapters") / ADAPTER
    write_random_adapter(folder, ModelConfig.from_file(tiny_llama / "config.json"), rank=8, seed=1)
    return folder


def _adapter(name: str, source: str, service: str = BASE) -> str:
    body = {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name},
        "spec": {"inferenceService": service, "source": source},
    }
    return yaml.safe_dump(body)


def _get(cluster: ClusterHandle, kind: str, name: str, namespace: str) -> dict | None:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def _conditions(obj: dict | None) -> dict[str, dict]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def _ready_pods(cluster: ClusterHandle, namespace: str) -> list[dict]:
    items = cluster.get_json("pods", "-n", namespace, "-l", f"flotilla.dev/inferenceservice={BASE}")["items"]
    return [
        p
        for p in items
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
    ]


def _served(endpoint: str) -> dict[str, str]:
    """The adapters the engine at this OpenAI base URL lists: name -> folder."""
    try:
        with urllib.request.urlopen(f"{endpoint}/models", timeout=10) as rsp:
            data = json.loads(rsp.read())["data"]
    except OSError:
        return {}
    return {m["id"]: m["root"] for m in data if m.get("parent")}


def _post(url: str, body: dict) -> int:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as rsp:
        return rsp.status


def _loaded_in(cluster: ClusterHandle, namespace: str, pod: str) -> dict | None:
    obj = _get(cluster, "loraadapter", ADAPTER, namespace)
    ready = _conditions(obj).get("Ready", {}).get("status") == "True"
    replicas = ((obj or {}).get("status") or {}).get("replicas") or []
    return obj if ready and [(r["pod"], r["phase"]) for r in replicas] == [(pod, "Loaded")] else None


@pytest.fixture
def cleaned(cluster: ClusterHandle, operator: OperatorProcess, namespace: str) -> Iterator[str]:
    """The namespace, emptied of this test's objects (the operator still running for their finalizers)
    before the namespace fixture drops it without waiting: a service left in a namespace no Tenant owns
    is visible to every key through a gateway in later tests, and its served name would become ambiguous."""
    yield namespace
    cluster.kubectl("delete", "loraadapter,fisvc", "--all", "-n", namespace, "--timeout=120s", check=False)


def test_adapter_loads_serves_reloads_into_a_new_pod_and_unloads(
    cluster, operator, cleaned, tiny_llama, adapter_dir
):
    namespace = cleaned
    # The replicas see the node folder adapterDir names (mounted at its own path), which holds the adapter.
    lora = {"enabled": True, "maxLoras": 2, "maxLoraRank": 16, "adapterDir": str(adapter_dir.parent)}
    engine = {"kvCacheMemory": "64Mi", "maxNumSeqs": 4, "lora": lora}
    cluster.apply(yaml.safe_dump(inference_service(BASE, tiny_llama, replicas=1, engine=engine)), namespace)

    # A source the operator cannot read is refused in status, naming the field and what is accepted.
    cluster.apply(_adapter("remote", "pvc://claim/adapter"), namespace)
    valid = wait_for(
        lambda: _conditions(_get(cluster, "loraadapter", "remote", namespace)).get("Valid"), 60, "Valid"
    )
    assert valid["status"] == "False" and "spec.source" in valid["message"], valid
    assert "pvc://claim/adapter" in valid["message"] and "file:///" in valid["message"], valid

    # Applied before the base is ready: it waits (Ready False), then loads when the replica is.
    cluster.apply(_adapter(ADAPTER, f"file://{adapter_dir}"), namespace)
    (pod,) = wait_for(lambda: _ready_pods(cluster, namespace), 300, "the base service's ready replica")
    name = pod["metadata"]["name"]
    endpoint = f"http://{pod['status']['podIP']}:8000/v1"
    obj = wait_for(lambda: _loaded_in(cluster, namespace, name), 120, f"{ADAPTER} Loaded in {name}")
    assert obj["status"]["loadedReplicas"] == 1 and obj["status"]["readyReplicas"] == 1
    assert _served(endpoint) == {ADAPTER: str(adapter_dir)}

    answer = complete(endpoint, model=ADAPTER)
    assert answer["model"] == ADAPTER and isinstance(answer["choices"][0]["text"], str)
    assert complete(endpoint, model="tiny")["model"] == "tiny"  # the base, beside it

    # The engine pod is killed: the Deployment's new pod gets the adapter without anyone re-applying it.
    cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=false")
    replaced = wait_for(
        lambda: [p for p in _ready_pods(cluster, namespace) if p["metadata"]["name"] != name] or None,
        300,
        "a new ready replica",
    )
    assert replaced is not None
    (new,) = replaced
    new_name = new["metadata"]["name"]
    new_endpoint = f"http://{new['status']['podIP']}:8000/v1"
    wait_for(lambda: ADAPTER in _served(new_endpoint), 60, f"{ADAPTER} reloaded into {new_name}")
    wait_for(lambda: _loaded_in(cluster, namespace, new_name), 60, f"status: {ADAPTER} Loaded in {new_name}")
    assert complete(new_endpoint, model=ADAPTER)["model"] == ADAPTER

    # The operator is down while the engine forgets the adapter (unloaded behind its back): once back, the
    # operator finds it missing and loads it again.
    operator.stop()
    _post(f"{new_endpoint}/unload_lora_adapter", {"lora_name": ADAPTER})
    assert ADAPTER not in _served(new_endpoint)
    operator.start()
    wait_for(lambda: ADAPTER in _served(new_endpoint), 60, f"{ADAPTER} reloaded after the operator's restart")

    # Deleted: the finalizer unloads it from the replica before the object goes.
    cluster.kubectl("delete", "loraadapter", ADAPTER, "-n", namespace, "--timeout=60s")
    assert _get(cluster, "loraadapter", ADAPTER, namespace) is None
    assert ADAPTER not in _served(new_endpoint)
    with pytest.raises(urllib.error.HTTPError) as refused:
        complete(new_endpoint, model=ADAPTER)
    assert refused.value.code == 404


@pytest.fixture
def archive_server(adapter_dir: Path) -> Iterator[tuple[str, list[str]]]:
    """A loopback HTTP server with one tar.gz of the adapter folder: its URL (with #sha256=), and the paths
    it was asked for. The local cluster's pods share the host's network (their IPs are loopback aliases), so
    an engine pod reaches it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(adapter_dir, arcname="sql-adapter")
    content, asked = buffer.getvalue(), []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            found = self.path == "/sql.tar.gz"
            self.send_response(200 if found else 404)
            self.send_header("Content-Length", str(len(content) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(content)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 -- the base class's name
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    sha = hashlib.sha256(content).hexdigest()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/sql.tar.gz#sha256={sha}", asked
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_an_archive_source_is_fetched_by_the_replicas_engine(
    cluster, operator, cleaned, tiny_llama, archive_server
):
    """No adapterDir: the operator sends the URI, and the engine in the pod downloads it into its cache."""
    namespace, (uri, asked) = cleaned, archive_server
    engine = {"kvCacheMemory": "64Mi", "maxNumSeqs": 4, "lora": {"enabled": True, "maxLoraRank": 16}}
    cluster.apply(yaml.safe_dump(inference_service(BASE, tiny_llama, replicas=1, engine=engine)), namespace)
    cluster.apply(_adapter(ADAPTER, uri), namespace)
    (pod,) = wait_for(lambda: _ready_pods(cluster, namespace), 300, "the base service's ready replica")
    name = pod["metadata"]["name"]
    endpoint = f"http://{pod['status']['podIP']}:8000/v1"
    try:
        obj = wait_for(lambda: _loaded_in(cluster, namespace, name), 120, f"{ADAPTER} Loaded in {name}")
    except AssertionError as exc:  # say why: the replicas' status carries the engine's refusal
        status = (_get(cluster, "loraadapter", ADAPTER, namespace) or {}).get("status")
        raise AssertionError(f"{exc}; status: {status}; the archive server was asked for {asked}") from None
    assert obj["status"]["replicas"][0]["message"] == f"loaded from {uri}"
    assert _served(endpoint) == {ADAPTER: uri}
    assert asked == ["/sql.tar.gz"]  # fetched once; the operator's later rounds find it loaded
    assert complete(endpoint, model=ADAPTER)["model"] == ADAPTER
