"""LoRAAdapters on the real local cluster: the operator (under its least-privilege ServiceAccount) loads an
adapter into the ready replica of its base InferenceService (the real engine, CPU, a random-weight tiny
model), the replica serves `model: <adapter>`, a replica that replaces a deleted pod gets the adapter
again, so does an engine that lost it while the operator was down, and deleting the adapter unloads it. A
source no engine can load is refused in status; an http(s) archive source is fetched by the replica's
engine itself; a pvc:// source is read from the base's adapterClaim (a hostPath PersistentVolume bound to
a claim of the test's namespace), and the time from `kubectl apply` of that LoRAAdapter to its first
served token is written to artifacts/lora-apply-to-first-token.json."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flotilla import manifest_yaml
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

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"
BASE = "base"
ADAPTER = "sql"


@pytest.fixture(scope="module")
def operator(cluster: ClusterHandle, tmp_path_factory) -> Iterator[OperatorProcess]:
    install_manifests(cluster)
    workdir = tmp_path_factory.mktemp("operator")
    kubeconfig = service_account_kubeconfig(cluster, workdir / "operator.kubeconfig")
    # The models' and adapters' folders are tmp_path_factory's, all under its base.
    proc = OperatorProcess(
        kubeconfig, workdir / "operator.log", host_path_roots=(tmp_path_factory.getbasetemp(),)
    )
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
    return manifest_yaml.dump(body)


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
    cluster.apply(
        manifest_yaml.dump(inference_service(BASE, tiny_llama, replicas=1, engine=engine)), namespace
    )

    # A source the operator cannot read is refused in status, naming the field and what is accepted.
    cluster.apply(_adapter("remote", "s3://bucket/adapter"), namespace)
    valid = wait_for(
        lambda: _conditions(_get(cluster, "loraadapter", "remote", namespace)).get("Valid"), 60, "Valid"
    )
    assert valid["status"] == "False" and "spec.source" in valid["message"], valid
    assert "s3://bucket/adapter" in valid["message"] and "file:///" in valid["message"], valid
    assert "pvc://<claim>/<folder>" in valid["message"], valid

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
    cluster.apply(
        manifest_yaml.dump(inference_service(BASE, tiny_llama, replicas=1, engine=engine)), namespace
    )
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


CLAIM = "lora-adapters"


@pytest.fixture
def adapter_claim(cluster: ClusterHandle, cleaned: str, adapter_dir: Path, tmp_path: Path) -> Iterator[str]:
    """A PersistentVolumeClaim of the test's namespace, bound to a hostPath PersistentVolume whose folder
    holds the adapter at team-a/sql (the local cluster's node agent mounts a claim from its volume's
    hostPath). The volume, cluster-wide, goes with the test."""
    root = tmp_path / "claim"
    shutil.copytree(adapter_dir, root / "team-a" / ADAPTER)
    volume = f"lora-{cleaned}"
    manifests = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(root), "type": "Directory"},
                "claimRef": {"namespace": cleaned, "name": CLAIM},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": CLAIM, "namespace": cleaned},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]
    cluster.apply(manifest_yaml.dump_all(manifests), cleaned)
    wait_for(
        lambda: (_get(cluster, "pvc", CLAIM, cleaned) or {}).get("status", {}).get("phase") == "Bound",
        60,
        f"claim {CLAIM} bound to {volume}",
    )
    yield CLAIM
    cluster.kubectl("delete", "pvc", CLAIM, "-n", cleaned, "--wait=false", check=False)
    cluster.kubectl("delete", "pv", volume, "--wait=false", check=False)


def _greedy(endpoint: str, model: str, max_tokens: int = 8) -> tuple[str, list[float]]:
    """A greedy completion's text and its tokens' logprobs (HTTPError while `model` is not served)."""
    body = {
        "model": model,
        "prompt": "SELECT name FROM",
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
    }
    request = urllib.request.Request(
        f"{endpoint}/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as rsp:
        choice = json.loads(rsp.read())["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def _first_token(endpoint: str, model: str, timeout: float) -> tuple[float, int]:
    """Seconds until a one-token completion of `model` is answered, polled every 50 ms (404 until the engine
    serves it), and the number of requests it took."""
    start, asked = time.monotonic(), 0
    while True:
        asked += 1
        try:
            _greedy(endpoint, model, max_tokens=1)
            return time.monotonic() - start, asked
        except urllib.error.HTTPError as exc:
            if exc.code != 404 or time.monotonic() - start > timeout:
                raise
        time.sleep(0.05)


def test_a_pvc_source_is_read_from_the_bases_adapter_claim_and_timed_from_apply_to_first_token(
    cluster, operator, cleaned, tiny_llama, adapter_dir, adapter_claim
):
    """The base mounts its adapterClaim read-only in every replica; a pvc://<claim>/<folder> source is sent to
    the engine as that folder there. Another claim is refused in status. Applied once the base is ready, the
    adapter's first served token comes within the create handler's round (not the 10 s timer's): the
    seconds are written to artifacts/ and not asserted (the machine's load decides them)."""
    namespace = cleaned
    # adapterDir too: the same folder's file:// source is the adapter's known output to compare with.
    lora = {"enabled": True, "maxLoras": 2, "maxLoraRank": 16, "adapterClaim": adapter_claim,
            "adapterDir": str(adapter_dir.parent)}  # fmt: skip
    engine = {"kvCacheMemory": "64Mi", "maxNumSeqs": 4, "lora": lora}
    cluster.apply(
        manifest_yaml.dump(inference_service(BASE, tiny_llama, replicas=1, engine=engine)), namespace
    )

    # A claim the base does not mount: not loaded, and Ready says which claim it mounts.
    cluster.apply(_adapter("elsewhere", "pvc://other-claim/team-a/sql"), namespace)
    ready = wait_for(
        lambda: _conditions(_get(cluster, "loraadapter", "elsewhere", namespace)).get("Ready"), 60, "Ready"
    )
    assert ready["status"] == "False" and ready["reason"] == "SourceOutsideAdapterClaim", ready
    assert "'pvc://other-claim/team-a/sql'" in ready["message"], ready
    assert f"pvc://{adapter_claim}/<folder>" in ready["message"], ready

    (pod,) = wait_for(lambda: _ready_pods(cluster, namespace), 300, "the base service's ready replica")
    name = pod["metadata"]["name"]
    endpoint = f"http://{pod['status']['podIP']}:8000/v1"
    base_text, base_logprobs = _greedy(endpoint, "tiny")

    started = time.monotonic()
    cluster.apply(_adapter(ADAPTER, f"pvc://{adapter_claim}/team-a/{ADAPTER}"), namespace)
    applied = time.monotonic() - started
    try:
        waited, asked = _first_token(endpoint, ADAPTER, timeout=120)
    except urllib.error.HTTPError as exc:  # say why: the replicas' status carries the engine's refusal
        status = (_get(cluster, "loraadapter", ADAPTER, namespace) or {}).get("status")
        raise AssertionError(f"{ADAPTER} not served ({exc.code}); status: {status}") from None
    first_token = applied + waited
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "lora-apply-to-first-token.json").write_text(json.dumps({
        "first_token_seconds": round(first_token, 3),
        "kubectl_apply_seconds": round(applied, 3),
        "requests_until_served": asked,
        "source": "pvc",
        "measured": "from `kubectl apply` of a LoRAAdapter on a base with a ready replica to a one-token "
        "completion of model: <adapter> answered by that replica's engine, asked every 50 ms",
    }, indent=2))  # fmt: skip

    obj = wait_for(lambda: _loaded_in(cluster, namespace, name), 60, f"{ADAPTER} Loaded in {name}")
    path = f"/mnt/lora-adapters/{adapter_claim}/team-a/{ADAPTER}"
    assert obj["status"]["replicas"][0]["message"] == f"loaded from {path}"
    assert _served(endpoint)[ADAPTER] == path

    # Served with the adapter's weights: as the same folder loaded by path answers, and not as the base.
    cluster.apply(_adapter("sql-by-path", f"file://{adapter_dir}"), namespace)
    wait_for(lambda: "sql-by-path" in _served(endpoint), 60, "sql-by-path loaded")
    text, logprobs = _greedy(endpoint, ADAPTER)
    known_text, known_logprobs = _greedy(endpoint, "sql-by-path")
    assert text == known_text and logprobs == pytest.approx(known_logprobs, abs=1e-5)
    assert logprobs != pytest.approx(base_logprobs, abs=1e-6), (text, base_text)
