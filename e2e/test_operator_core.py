"""The operator on the real local cluster: CRDs, the operator as a subprocess under its least-privilege
ServiceAccount, and InferenceServices turned into Deployments, Services, PDBs, pods and status.

Most tests point the pods at an empty model folder, so the engine exits at start: they assert on objects,
status and conditions (the crash itself shows as Degraded) and stay cheap. One test runs the real engine
(`flotilla engine serve` on a random-weight tiny model, CPU): Ready=True, a completion through the pod IP,
and recovery after the engine process is killed."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle, wait_for
from flotilla.operator.cmd.local import (
    OPERATOR_NS,
    OPERATOR_SA,
    OperatorProcess,
    complete,
    inference_service,
    install_manifests,
    service_account_kubeconfig,
    tiny_model,
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def operator(cluster: ClusterHandle, tmp_path_factory) -> Iterator[OperatorProcess]:
    install_manifests(cluster)
    workdir = tmp_path_factory.mktemp("operator")
    kubeconfig = service_account_kubeconfig(cluster, workdir / "operator.kubeconfig")
    # The tests' model folders are tmp_path's (under tmp_path_factory's base); /nonexistent is a root that
    # does not exist, so that a model under it is allowed and then not found (the missing-path case).
    roots = (tmp_path_factory.getbasetemp(), "/nonexistent")
    proc = OperatorProcess(kubeconfig, workdir / "operator.log", host_path_roots=roots)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def model_dir(tmp_path) -> Path:
    # A path that exists on the (shared) filesystem; the engine is not started on it in these tests.
    path = tmp_path / "tiny-model"
    path.mkdir()
    return path


def _isvc(name: str, model: Path | str, *, replicas: int = 1, **spec) -> str:
    return manifest_yaml.dump(inference_service(name, model, replicas=replicas, **spec))


def _get(cluster: ClusterHandle, kind: str, name: str, namespace: str) -> dict | None:
    result = cluster.kubectl(
        "get", kind, name, "-n", namespace, "-o", "json", "--show-managed-fields", check=False
    )
    return json.loads(result.stdout) if result.returncode == 0 else None


def _conditions(obj: dict | None) -> dict[str, dict]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def _condition(cluster, namespace, name, type_, status, timeout: float = 90):
    def check():
        cond = _conditions(_get(cluster, "fisvc", name, namespace)).get(type_)
        return cond if cond and cond["status"] == status else None

    return wait_for(check, timeout, f"{name}: condition {type_}={status}")


POOL = "inferencepools.inference.networking.k8s.io"  # the Gateway API Inference Extension's


def _pool_entry(cluster: ClusterHandle, namespace: str, name: str) -> dict | None:
    """The operator's entry in the InferencePool's status.parents, with its conditions by type."""
    parents = ((_get(cluster, POOL, name, namespace) or {}).get("status") or {}).get("parents") or []
    mine = [p for p in parents if p.get("controllerName") == "flotilla.dev/operator"]
    return {**mine[0], "conditions": {c["type"]: c for c in mine[0]["conditions"]}} if mine else None


def _pods(cluster: ClusterHandle, namespace: str, name: str) -> list[dict]:
    items = cluster.get_json("pods", "-n", namespace, "-l", f"flotilla.dev/inferenceservice={name}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def _events(cluster: ClusterHandle, namespace: str, name: str) -> list[dict]:
    return cluster.get_json("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")[
        "items"
    ]


# ---------------------------------------------------------------------------------------------------


def test_schema_rejects_malformed_input_naming_the_field(cluster, operator, namespace):
    cases = {
        "spec.replicas": {"replicas": -1},
        "spec.engine.dtype": {"engine": {"dtype": "int3"}},
        "spec.engine.schedulingPolicy": {"engine": {"schedulingPolicy": "lottery"}},
        "spec.engine.speculative.method": {"engine": {"speculative": {"method": "medusa"}}},
        "spec.engine.speculative.numSpeculativeTokens": {
            "engine": {"speculative": {"method": "ngram", "numSpeculativeTokens": 17}}
        },
        "spec.resources.gpus": {"resources": {"gpus": 99, "gpuType": "h100"}},
        "replicaz": {"replicaz": 3},  # unknown fields are refused by kubectl's strict field validation
    }
    for field, override in cases.items():
        replicas = override.pop("replicas", 1)
        manifest = _isvc("bad", "file:///models/x", replicas=replicas, **override)
        result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=manifest, check=False)
        assert result.returncode != 0, f"{field}: {result.stdout}"
        assert field in result.stderr, result.stderr

    missing_model = "apiVersion: flotilla.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: bad}\nspec: {replicas: 1}\n"
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=missing_model, check=False)
    assert result.returncode != 0 and "spec.model" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("uri", "override", "reason", "words"),
    [
        ("s3://bucket/model", {}, "InvalidModelUri", "unsupported uri scheme 's3'"),
        (
            "file:///nonexistent/flotilla-model",
            {},
            "ModelNotFound",
            "/nonexistent/flotilla-model does not exist",
        ),
        (
            "file:///etc/kubernetes",
            {},
            "HostPathNotAllowed",
            "spec.model.uri: 'file:///etc/kubernetes' (host path /etc/kubernetes): under none of the host-path "
            "roots the operator allows",
        ),
        (
            None,
            {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
            "InvalidReplicaRange",
            "minReplicas (5)",
        ),
        (
            None,
            {"resources": {"gpus": 1, "gpuType": "a100"}},
            "UnknownGPUType",
            "no node has GPU type 'a100'",
        ),
        (
            None,
            {"engine": {"speculative": {"method": "ngram", "model": {"uri": "hf://acme/draft"}}}},
            "InvalidSpeculative",
            "spec.engine.speculative.model: method 'ngram' takes no draft model, got uri 'hf://acme/draft'",
        ),
        (
            None,
            {"engine": {"quantization": "int8", "quantizationGroupSize": 64}},
            "InvalidQuantization",
            "spec.engine.quantizationGroupSize: 64 is set while quantization is 'int8'",
        ),
    ],
    ids=[
        "scheme",
        "missing-path",
        "host-path-outside-roots",
        "min-over-max",
        "gpu-type",
        "ngram-with-model",
        "group-size-without-int4",
    ],
)
def test_wrong_meaning_is_invalid_with_a_warning_and_nothing_created(
    cluster, operator, namespace, model_dir, uri, override, reason, words
):
    cluster.apply(_isvc("wrong", uri or model_dir, **override), namespace)
    valid = _condition(cluster, namespace, "wrong", "Valid", "False")
    assert valid["reason"] == reason and words in valid["message"], valid
    status = _get(cluster, "fisvc", "wrong", namespace)["status"]
    assert _conditions({"status": status})["Ready"]["status"] == "False"
    assert words in status["message"]
    warning = wait_for(
        lambda: [
            e
            for e in _events(cluster, namespace, "wrong")
            if e["type"] == "Warning" and e["reason"] == reason
        ],
        30,
        f"a Warning event {reason}",
    )
    assert words in warning[0]["message"]
    assert _get(cluster, "deployment", "wrong", namespace) is None
    assert _get(cluster, "service", "wrong", namespace) is None


def test_service_gets_owned_children_pods_and_status(cluster, operator, namespace, model_dir):
    engine = {"maxNumSeqs": 8, "schedulingPolicy": "fair"}
    cluster.apply(_isvc("chat", model_dir, replicas=2, engine=engine), namespace)
    dep = wait_for(lambda: _get(cluster, "deployment", "chat", namespace), 60, "the Deployment")
    command = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--scheduling-policy") + 1] == "fair", command
    isvc = _get(cluster, "fisvc", "chat", namespace)
    for kind in ("deployment", "service", "poddisruptionbudget", POOL):
        obj = wait_for(lambda kind=kind: _get(cluster, kind, "chat", namespace), 60, kind)
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == isvc["metadata"]["uid"] and ref["controller"] is True
        managers = {m["manager"] for m in obj["metadata"]["managedFields"] if m["operation"] == "Apply"}
        assert managers == {"flotilla"}

    # The InferencePool, as the API server kept it under the standard's schema: the engine pods on the
    # engine port, and Flotilla's picker.
    pool = _get(cluster, POOL, "chat", namespace)["spec"]
    assert pool["selector"] == {"matchLabels": {"flotilla.dev/inferenceservice": "chat"}}
    assert pool["selector"] == dep["spec"]["selector"]
    assert pool["targetPorts"] == [{"number": 8000}]
    picker = pool["endpointPickerRef"]
    assert (picker["kind"], picker["name"], picker["port"], picker["failureMode"]) == (
        "Service",
        "flotilla-gateway",
        {"number": 9002},
        "FailClose",
    )
    # Its status: Flotilla's gateway accepts it, and the reference resolves: the operator keeps the picker's
    # Service in the namespace (test_the_picker_service_reaches_the_gateway_pods).
    entry = wait_for(
        lambda: (
            (e := _pool_entry(cluster, namespace, "chat"))
            and e["conditions"]["ResolvedRefs"]["status"] == "True"
            and e
        ),
        60,
        "the pool's status entry, ResolvedRefs=True",
    )
    assert entry["parentRef"] == {
        "group": "",
        "kind": "Service",
        "name": "flotilla-gateway",
        "namespace": OPERATOR_NS,
    }
    assert entry["conditions"]["Accepted"]["status"] == "True"
    assert entry["conditions"]["ResolvedRefs"]["reason"] == "ResolvedRefs"

    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pods = wait_for(
        lambda: len(_pods(cluster, namespace, "chat")) == 2 and _pods(cluster, namespace, "chat"),
        60,
        "2 pods",
    )
    container = pods[0]["spec"]["containers"][0]
    assert container["command"][:3] == ["flotilla", "engine", "serve"]
    assert "--max-num-seqs" in container["command"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pods[0]["spec"]["nodeSelector"] == {"flotilla.dev/gpu-type": "h100"}
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    assert env["FLOTILLA_SERVICE"] == "chat" and env["FLOTILLA_TENANT"] == ""

    _condition(cluster, namespace, "chat", "Valid", "True")
    admitted = _condition(cluster, namespace, "chat", "QuotaAdmitted", "True")
    assert admitted["reason"] == "NoTenant"
    status = wait_for(
        lambda: (s := _get(cluster, "fisvc", "chat", namespace)["status"]).get("replicas") == 2 and s,
        60,
        "status.replicas",
    )
    assert status["desiredReplicas"] == 2 and status["gpus"] == 2
    assert status["selector"] == "flotilla.dev/inferenceservice=chat"
    # No engine server yet: the pods' processes exit, and status says so rather than hiding it.
    degraded = _condition(cluster, namespace, "chat", "Degraded", "True")
    assert "pod chat-" in degraded["message"]
    assert _conditions(_get(cluster, "fisvc", "chat", namespace))["Ready"]["status"] == "False"

    table = cluster.kubectl("get", "fisvc", "chat", "-n", namespace).stdout
    for column in ("READY", "REPLICAS", "GPUS", "MODEL", "AGE"):
        assert column in table


SLICE = "endpointslices.discovery.k8s.io"


def _gateway_stand_in(name: str, *, runs: bool) -> str:
    """A pod with the gateway's labels in the operator's namespace: the operator lists it in each
    namespace's picker EndpointSlice as it would the chart's gateway pods. The local cluster's pods have
    loopback IPs, which no EndpointSlice may hold, so one that `runs` (something trivial) must not be
    listed; one that never runs (nothing schedules it) is a pod whose status the test writes, as a kubelet
    would, with an address a slice may hold."""
    spec: dict = {"containers": [{"name": "gateway", "image": "none", "command": ["sleep", "600"]}],
                  "terminationGracePeriodSeconds": 1}  # fmt: skip
    if not runs:
        spec["nodeSelector"] = {"flotilla.dev/no-such-node": "true"}
    labels = {"app.kubernetes.io/name": "flotilla-gateway", "app.kubernetes.io/instance": "e2e"}
    return manifest_yaml.dump({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
                           "spec": spec})  # fmt: skip


def _write_pod_status(cluster: ClusterHandle, name: str, ip: str, ready: bool) -> None:
    status = {"podIP": ip, "podIPs": [{"ip": ip}],
              "conditions": [{"type": "Ready", "status": str(ready)}]}  # fmt: skip
    cluster.kubectl("patch", "pod", name, "-n", OPERATOR_NS, "--subresource=status", "--type=strategic",
                    "-p", json.dumps({"status": status}))  # fmt: skip


def _slice_endpoints(cluster: ClusterHandle, namespace: str) -> dict[str, dict] | None:
    """The picker EndpointSlice's endpoints by address (None: no slice)."""
    obj = _get(cluster, SLICE, "flotilla-gateway-picker", namespace)
    if obj is None:
        return None
    return {e["addresses"][0]: e for e in obj.get("endpoints") or []}


def test_the_picker_service_reaches_the_gateway_pods(cluster, operator, namespace, model_dir):
    run = uuid.uuid4().hex[:6]
    running, written = f"gateway-running-{run}", f"gateway-written-{run}"
    ip = "10.80.0.7"  # the written one's
    cluster.apply(_gateway_stand_in(running, runs=True), OPERATOR_NS)
    cluster.apply(_gateway_stand_in(written, runs=False), OPERATOR_NS)
    try:
        cluster.apply(_isvc("one", model_dir), namespace)
        cluster.apply(_isvc("two", model_dir), namespace)
        uids = {
            wait_for(lambda n=n: _get(cluster, "fisvc", n, namespace), 30, n)["metadata"]["uid"]
            for n in ("one", "two")
        }

        # The Service the pools' endpointPickerRef names, in the pools' namespace: no selector, the picker's
        # port, owned by both services (and by neither as controller).
        svc = wait_for(
            lambda: (
                (s := _get(cluster, "service", "flotilla-gateway", namespace))
                and {r["uid"] for r in s["metadata"].get("ownerReferences") or []} == uids
                and s
            ),
            60,
            "the picker's Service, owned by both services",
        )
        assert "selector" not in svc["spec"]
        (port,) = svc["spec"]["ports"]
        assert (port["port"], port["appProtocol"], port["protocol"]) == (9002, "kubernetes.io/h2c", "TCP")
        assert not any(r.get("controller") for r in svc["metadata"]["ownerReferences"])
        for name in ("one", "two"):
            wait_for(
                lambda name=name: (
                    (e := _pool_entry(cluster, namespace, name))
                    and e["conditions"]["ResolvedRefs"]["status"] == "True"
                ),
                60,
                f"{name}: ResolvedRefs=True",
            )

        # Its EndpointSlice: the running pod (a loopback IP) is Ready but not listed; the written one is
        # listed on 9002, ready as its Ready condition says.
        loopback = wait_for(
            lambda: (
                (p := _get(cluster, "pod", running, OPERATOR_NS))
                and _conditions(p).get("Ready", {}).get("status") == "True"
                and p["status"]["podIP"]
            ),
            60,
            "the running stand-in to be Ready",
        )
        _write_pod_status(cluster, written, ip, ready=True)
        endpoints = wait_for(
            lambda: (
                (e := _slice_endpoints(cluster, namespace))
                and ip in e
                and e[ip]["conditions"]["ready"] is True
                and e
            ),
            60,
            "the slice to list the written stand-in, ready",
        )
        assert loopback not in endpoints and list(endpoints) == [ip], endpoints
        assert endpoints[ip]["targetRef"]["name"] == written
        assert endpoints[ip]["targetRef"]["namespace"] == OPERATOR_NS
        obj = _get(cluster, SLICE, "flotilla-gateway-picker", namespace)
        assert obj["metadata"]["labels"]["kubernetes.io/service-name"] == "flotilla-gateway"
        assert obj["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] == "operator.flotilla.dev"
        assert {r["uid"] for r in obj["metadata"]["ownerReferences"]} == uids
        assert obj["ports"] == [
            {"name": "grpc-ext-proc", "port": 9002, "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}
        ]
        _write_pod_status(cluster, written, ip, ready=False)
        wait_for(
            lambda: (
                (_slice_endpoints(cluster, namespace) or {}).get(ip, {}).get("conditions", {}).get("ready")
                is False
            ),
            60,
            "the slice to say the stand-in is not ready",
        )
        _write_pod_status(cluster, written, ip, ready=True)

        # Drift: a deleted slice comes back.
        cluster.kubectl("delete", SLICE, "flotilla-gateway-picker", "-n", namespace)
        wait_for(lambda: ip in (_slice_endpoints(cluster, namespace) or {}), 60, "the slice re-created")

        # One service goes: the objects stay, owned by the other.
        cluster.kubectl("delete", "fisvc", "one", "-n", namespace)
        wait_for(
            lambda: (
                len((_get(cluster, "service", "flotilla-gateway", namespace) or {})
                    .get("metadata", {}).get("ownerReferences") or []) == 1
            ),
            60,
            "the picker's Service owned by the remaining service only",
        )  # fmt: skip
        assert _slice_endpoints(cluster, namespace) is not None

        # The gateway pod goes: the slice drops it.
        cluster.kubectl("delete", "pod", written, "-n", OPERATOR_NS, "--wait=false")
        wait_for(
            lambda: (e := _slice_endpoints(cluster, namespace)) is not None and ip not in e,
            60,
            "the slice to drop the deleted pod",
        )

        # The last service goes: the garbage collector removes both.
        cluster.kubectl("delete", "fisvc", "two", "-n", namespace)
        wait_for(
            lambda: _get(cluster, "service", "flotilla-gateway", namespace) is None,
            90,
            "the picker's Service to be collected",
        )
        wait_for(lambda: _slice_endpoints(cluster, namespace) is None, 90, "the slice to be collected")

        # A flotilla-gateway Service someone else made is never adopted: the pool says what it lacks.
        cluster.apply(
            textwrap.dedent("""
            apiVersion: v1
            kind: Service
            metadata: {name: flotilla-gateway, labels: {app: theirs}}
            spec: {selector: {app: theirs}, ports: [{name: http, port: 80}]}
            """),
            namespace,
        )
        cluster.apply(_isvc("three", model_dir), namespace)
        entry = wait_for(
            lambda: (e := _pool_entry(cluster, namespace, "three")) and e,
            60,
            "three: the pool's status entry",
        )
        resolved = entry["conditions"]["ResolvedRefs"]
        assert (resolved["status"], resolved["reason"]) == ("False", "InvalidExtensionRef"), resolved
        assert "has no port 9002" in resolved["message"]
        theirs = _get(cluster, "service", "flotilla-gateway", namespace)
        assert theirs["spec"]["selector"] == {"app": "theirs"}
        assert [p["port"] for p in theirs["spec"]["ports"]] == [80]
        assert not theirs["metadata"].get("ownerReferences")
        assert _slice_endpoints(cluster, namespace) is None
    finally:
        for pod in (running, written):
            cluster.kubectl("delete", "pod", pod, "-n", OPERATOR_NS, "--wait=false", check=False)


def test_a_draft_model_is_mounted_beside_the_served_one(cluster, operator, namespace, model_dir, tmp_path):
    draft_dir = tmp_path / "tiny-draft"
    draft_dir.mkdir()
    speculative = {"method": "draft", "numSpeculativeTokens": 3, "model": {"uri": f"file://{draft_dir}"}}
    cluster.apply(_isvc("spec", model_dir, engine={"speculative": speculative}), namespace)
    _condition(cluster, namespace, "spec", "Valid", "True")
    # The API server took the pod template: two host paths under distinct volume names.
    (pod,) = wait_for(lambda: _pods(cluster, namespace, "spec"), 60, "the pod")
    command = pod["spec"]["containers"][0]["command"]
    assert command[command.index("--speculative-method") + 1] == "draft", command
    assert command[command.index("--speculative-model") + 1] == str(draft_dir), command
    assert command[command.index("--num-speculative-tokens") + 1] == "3", command
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["model"]["hostPath"]["path"] == str(model_dir)
    assert volumes["draft-model"]["hostPath"]["path"] == str(draft_dir)


def test_kubectl_scale_changes_the_pods(cluster, operator, namespace, model_dir):
    cluster.apply(_isvc("scaled", model_dir, replicas=1), namespace)
    wait_for(lambda: len(_pods(cluster, namespace, "scaled")) == 1, 60, "1 pod")
    cluster.kubectl("scale", "fisvc", "scaled", "-n", namespace, "--replicas", "3")
    wait_for(lambda: len(_pods(cluster, namespace, "scaled")) == 3, 90, "3 pods after kubectl scale")
    scale = json.loads(
        cluster.kubectl(
            "get",
            "--raw",
            f"/apis/flotilla.dev/v1alpha1/namespaces/{namespace}/inferenceservices/scaled/scale",
        ).stdout
    )
    assert scale["spec"]["replicas"] == 3
    wait_for(lambda: scale_status(cluster, namespace) == 3, 60, "the scale subresource's status.replicas")
    cluster.kubectl("scale", "fisvc", "scaled", "-n", namespace, "--replicas", "1")
    wait_for(lambda: len(_pods(cluster, namespace, "scaled")) == 1, 90, "1 pod after scaling down")


def scale_status(cluster, namespace) -> int:
    raw = cluster.kubectl(
        "get", "--raw", f"/apis/flotilla.dev/v1alpha1/namespaces/{namespace}/inferenceservices/scaled/scale"
    )
    return json.loads(raw.stdout).get("status", {}).get("replicas", 0)


def test_drift_on_children_is_corrected(cluster, operator, namespace, model_dir):
    cluster.apply(_isvc("steady", model_dir, replicas=1), namespace)
    wait_for(lambda: _get(cluster, "service", "steady", namespace), 60, "the Service")
    wait_for(lambda: _get(cluster, "deployment", "steady", namespace), 60, "the Deployment")

    cluster.kubectl("scale", "deployment", "steady", "-n", namespace, "--replicas", "4")
    wait_for(
        lambda: _get(cluster, "deployment", "steady", namespace)["spec"]["replicas"] == 1,
        60,
        "the Deployment's replicas to return to the InferenceService's 1",
    )
    patch = '[{"op": "replace", "path": "/spec/template/spec/containers/0/command/0", "value": "evil"}]'
    cluster.kubectl("patch", "deployment", "steady", "-n", namespace, "--type=json", "-p", patch)
    wait_for(
        lambda: (
            _get(cluster, "deployment", "steady", namespace)["spec"]["template"]["spec"]["containers"][0][
                "command"
            ][0]
            == "flotilla"
        ),
        60,
        "the engine command to be restored",
    )
    old_uid = _get(cluster, "service", "steady", namespace)["metadata"]["uid"]
    cluster.kubectl("delete", "service", "steady", "-n", namespace)
    wait_for(
        lambda: (svc := _get(cluster, "service", "steady", namespace)) and svc["metadata"]["uid"] != old_uid,
        60,
        "the deleted Service to be re-created",
    )
    pool_uid = wait_for(lambda: _get(cluster, POOL, "steady", namespace), 60, "the pool")["metadata"]["uid"]
    cluster.kubectl("delete", POOL, "steady", "-n", namespace)
    wait_for(
        lambda: (pool := _get(cluster, POOL, "steady", namespace)) and pool["metadata"]["uid"] != pool_uid,
        60,
        "the deleted InferencePool to be re-created",
    )


def test_deleting_the_service_removes_everything(cluster, operator, namespace, model_dir):
    cluster.apply(_isvc("gone", model_dir, replicas=2), namespace)
    wait_for(lambda: len(_pods(cluster, namespace, "gone")) == 2, 60, "2 pods")
    wait_for(lambda: _get(cluster, "poddisruptionbudget", "gone", namespace), 60, "the PDB")
    wait_for(lambda: _get(cluster, POOL, "gone", namespace), 60, "the InferencePool")
    cluster.kubectl("delete", "fisvc", "gone", "-n", namespace)
    for kind in ("deployment", "service", "poddisruptionbudget", POOL):
        wait_for(
            lambda kind=kind: _get(cluster, kind, "gone", namespace) is None,
            90,
            f"the {kind} to be collected",
        )
    wait_for(lambda: not _pods(cluster, namespace, "gone"), 90, "the pods to be removed")


def test_quota_holds_back_replicas_and_says_so(cluster, operator, namespace, model_dir):
    tenant = f"tenant-{uuid.uuid4().hex[:6]}"
    cluster.apply(
        textwrap.dedent(f"""
        apiVersion: flotilla.dev/v1alpha1
        kind: Tenant
        metadata: {{name: {tenant}}}
        spec: {{namespaces: [{namespace}], gpuQuota: {{h100: 2}}}}
        """)
    )
    try:
        cluster.apply(_isvc("greedy", model_dir, replicas=3), namespace)
        refused = _condition(cluster, namespace, "greedy", "QuotaAdmitted", "False")
        assert refused["reason"] == "QuotaExceeded"
        for words in (f"tenant {tenant}", "3 replicas x 1 h100 GPUs = 3", "quota is 2"):
            assert words in refused["message"], refused["message"]
        wait_for(
            lambda: (
                (_get(cluster, "deployment", "greedy", namespace) or {}).get("spec", {}).get("replicas") == 2
            ),
            60,
            "the Deployment to be held at the 2 replicas the quota admits",
        )
        status = _get(cluster, "fisvc", "greedy", namespace)["status"]
        assert status["desiredReplicas"] == 2 and f"tenant {tenant}" in status["message"]
        pods = wait_for(lambda: _pods(cluster, namespace, "greedy"), 60, "pods")
        env = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}
        assert env["FLOTILLA_TENANT"] == tenant

        # Raising the quota admits the rest without touching the InferenceService.
        cluster.kubectl(
            "patch", "tenant", tenant, "--type=merge", "-p", '{"spec": {"gpuQuota": {"h100": 4}}}'
        )
        _condition(cluster, namespace, "greedy", "QuotaAdmitted", "True")
        wait_for(
            lambda: _get(cluster, "deployment", "greedy", namespace)["spec"]["replicas"] == 3,
            60,
            "3 replicas admitted",
        )
    finally:
        cluster.kubectl("delete", "tenant", tenant, "--wait=false", check=False)


def test_refusals_by_the_api_show_in_status(cluster, operator, namespace, model_dir):
    # A namespace ResourceQuota (the platform's backstop) refuses the Service and the GPU pods.
    cluster.apply(
        textwrap.dedent("""
        apiVersion: v1
        kind: ResourceQuota
        metadata: {name: backstop}
        spec: {hard: {services: "0", requests.nvidia.com/gpu: "0"}}
        """),
        namespace,
    )
    wait_for(
        lambda: (cluster.get_json("resourcequota", "backstop", "-n", namespace).get("status") or {}).get(
            "hard"
        ),
        60,
        "the quota controller to fill the quota's status",
    )
    cluster.apply(_isvc("refused", model_dir, replicas=1), namespace)

    def degraded_with(words):
        cond = _conditions(_get(cluster, "fisvc", "refused", namespace)).get("Degraded") or {}
        return cond if cond.get("status") == "True" and words in cond.get("message", "") else None

    applied = wait_for(lambda: degraded_with("exceeded quota"), 90, "Degraded naming the refused Service")
    assert applied["reason"] == "ApplyFailed" and "Service refused" in applied["message"]
    assert wait_for(
        lambda: [e for e in _events(cluster, namespace, "refused") if e["reason"] == "ApplyFailed"],
        30,
        "an event",
    )
    # Lift the Service refusal: what remains is the pods' refusal, reported from the Deployment.
    cluster.kubectl("patch", "resourcequota", "backstop", "-n", namespace, "--type=merge", "-p",
                    '{"spec": {"hard": {"services": "10", "requests.nvidia.com/gpu": "0"}}}')  # fmt: skip
    pods_refused = wait_for(
        lambda: degraded_with("requests.nvidia.com/gpu"), 120, "Degraded naming the GPU quota"
    )
    assert pods_refused["message"].startswith("deployment: FailedCreate"), pods_refused


def test_operator_restart_converges_without_duplicates(cluster, operator, namespace, model_dir):
    cluster.apply(_isvc("durable", model_dir, replicas=1), namespace)
    wait_for(lambda: len(_pods(cluster, namespace, "durable")) == 1, 60, "1 pod")
    operator.stop(signal.SIGKILL)  # a crash: no cleanup, its peering entry stays behind
    try:
        # Changes made while no operator runs.
        cluster.kubectl("scale", "fisvc", "durable", "-n", namespace, "--replicas", "2")
        cluster.apply(_isvc("latecomer", model_dir, replicas=1), namespace)
    finally:
        operator.start()
    wait_for(lambda: len(_pods(cluster, namespace, "durable")) == 2, 90, "durable: 2 pods after the restart")
    wait_for(lambda: len(_pods(cluster, namespace, "latecomer")) == 1, 90, "latecomer: its pod")
    deployments = cluster.get_json("deployments", "-n", namespace)["items"]
    assert sorted(d["metadata"]["name"] for d in deployments) == ["durable", "latecomer"]
    replica_sets = cluster.get_json(
        "replicasets", "-n", namespace, "-l", "flotilla.dev/inferenceservice=durable"
    )
    assert len(replica_sets["items"]) == 1  # the restart re-applied the same template: no new rollout


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


def test_engine_pod_becomes_ready_serves_and_recovers_from_a_kill(cluster, operator, namespace, tiny_llama):
    """The real engine (`flotilla engine serve`, CPU, random-weight tiny model) in a pod the operator made."""
    cluster.apply(
        _isvc("live", tiny_llama, replicas=1, engine={"kvCacheMemory": "64Mi", "maxNumSeqs": 4}), namespace
    )
    _condition(cluster, namespace, "live", "Ready", "True", timeout=300)
    status = _get(cluster, "fisvc", "live", namespace)["status"]
    (endpoint,) = status["endpoints"]
    answer = complete(endpoint)
    assert answer["model"] == "tiny" and isinstance(answer["choices"][0]["text"], str)

    (pod,) = _pods(cluster, namespace, "live")
    pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("flotilla://"))
    os.kill(pid, signal.SIGKILL)
    restarted = wait_for(
        lambda: next(
            (
                p
                for p in _pods(cluster, namespace, "live")
                if p["status"]["containerStatuses"][0]["restartCount"] >= 1
                and p["status"]["containerStatuses"][0].get("ready")
            ),
            None,
        ),
        300,
        "the killed engine to be restarted and ready again",
    )
    assert restarted["metadata"]["name"] == pod["metadata"]["name"]  # the same pod, restarted in place
    _condition(cluster, namespace, "live", "Ready", "True", timeout=120)
    endpoint = wait_for(
        lambda: _get(cluster, "fisvc", "live", namespace)["status"]["endpoints"], 60, "endpoints"
    )[0]
    assert complete(endpoint)["choices"]


def _ready_endpoints(cluster: ClusterHandle, namespace: str, service: str) -> list[str]:
    """What a router uses here: status.endpoints, the ready pods that are not terminating. (The Service's
    EndpointSlices would be the usual source, but they cannot hold the local pods' loopback addresses.)"""
    obj = _get(cluster, "fisvc", service, namespace) or {}
    return sorted((obj.get("status") or {}).get("endpoints") or [])


def test_rollout_drops_no_request(cluster, operator, namespace, tiny_llama):
    """A spec change rolls out (maxUnavailable 0, surge 1) while a client keeps sending completions to
    the service's ready endpoints: every request succeeds, and both the old and the new pod answered."""
    engine = {"kvCacheMemory": "64Mi", "maxNumSeqs": 4}
    cluster.apply(_isvc("rolling", tiny_llama, replicas=1, engine=engine), namespace)
    _condition(cluster, namespace, "rolling", "Ready", "True", timeout=300)
    old_endpoints = wait_for(lambda: _ready_endpoints(cluster, namespace, "rolling"), 60, "an endpoint")

    answered: list[str] = []
    failures: list[str] = []
    stop = threading.Event()

    def client() -> None:
        turn = 0
        while not stop.is_set():
            endpoints = _ready_endpoints(cluster, namespace, "rolling")
            if not endpoints:
                failures.append("no ready endpoint")
                time.sleep(0.2)
                continue
            endpoint = endpoints[turn % len(endpoints)]
            turn += 1
            try:
                complete(endpoint)
                answered.append(endpoint)
            except Exception as exc:  # noqa: BLE001 - every failure is what the test reports
                failures.append(f"{endpoint}: {exc!r}")

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(answered) >= 3, 120, "requests before the rollout")
        engine["maxNumSeqs"] = 6  # a new pod template: the Deployment rolls
        cluster.apply(_isvc("rolling", tiny_llama, replicas=1, engine=engine), namespace)

        def rolled_out():
            pods = _pods(cluster, namespace, "rolling")
            command = pods[0]["spec"]["containers"][0]["command"] if len(pods) == 1 else []
            ready = _ready_endpoints(cluster, namespace, "rolling")
            return "6" in command and ready and ready != old_endpoints and ready

        new_endpoints = wait_for(rolled_out, 300, "the rollout to replace the pod")
        served_new = len([e for e in answered if e in new_endpoints])
        wait_for(
            lambda: len([e for e in answered if e in new_endpoints]) >= served_new + 3, 120, "requests after"
        )
    finally:
        stop.set()
        thread.join(timeout=90)
    assert not failures, failures[:5]
    assert set(old_endpoints) & set(answered) and set(new_endpoints) & set(answered), (
        old_endpoints,
        new_endpoints,
    )


def test_operator_serves_metrics_and_health(cluster, operator):
    code, _ = operator.get("/healthz")
    assert code == 200
    code, text = operator.get("/metrics")
    assert code == 200
    assert "flotilla_reconcile_duration_seconds_bucket" in text
    assert "flotilla_reconcile_errors_total" in text or "flotilla_reconciles_total" in text


def test_operator_identity_is_least_privilege(cluster, operator):
    who = f"--as=system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}"
    for verb, resource, allowed in [
        ("patch", "deployments", "yes"),
        ("delete", "deployments", "no"),
        ("get", "secrets", "no"),
        ("create", "pods", "no"),
        ("patch", "inferenceservices.flotilla.dev/status", "yes"),
        ("patch", POOL, "yes"),
        ("patch", f"{POOL}/status", "yes"),
        ("delete", POOL, "no"),
        ("list", SLICE, "yes"),
        ("create", SLICE, "no"),  # only the picker's slice, by name
        ("patch", f"{SLICE}/flotilla-gateway-picker", "yes"),
        ("delete", SLICE, "no"),
    ]:
        result = cluster.kubectl("auth", "can-i", verb, resource, who, "-A", check=False)
        assert result.stdout.strip() == allowed, (verb, resource, result.stdout, result.stderr)
