"""Tenancy on the real local cluster: two Tenants, the admission webhook (TLS from the operator's own CA,
failurePolicy Fail), RBAC isolation with real client certificates, and GPU metering that survives
SIGKILLed operators and matches the pods' own timestamps.

The operator runs as a subprocess under its least-privilege ServiceAccount with --webhook-port, so the
API server calls it at https://127.0.0.1:PORT. The webhook configuration is removed afterwards: with
failurePolicy Fail, a configuration whose operator is gone would refuse every later InferenceService.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client.parser import text_string_to_metric_families

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle, free_port, wait_for
from flotilla.operator.cmd.local import (
    OPERATOR_NS,
    OperatorProcess,
    install_manifests,
    kubeconfig_for,
    service_account_kubeconfig,
)
from flotilla.operator.naming import METERING_FINALIZER

pytestmark = pytest.mark.cluster

WEBHOOK_CONFIG = "flotilla.dev"
METERING_INTERVAL = 2.0
RUN = uuid.uuid4().hex[:5]  # names of cluster-scoped objects differ per run
MODEL_DIR = Path(f"/tmp/flotilla-tenancy-model-{RUN}")  # exists; the engine is not started on it here


def _user_kubeconfig(cluster: ClusterHandle, workdir: Path, user: str, group: str) -> Path:
    """A real identity: a client certificate (CN=user, O=group) signed by the cluster's CA."""
    pki = cluster.config.pki_dir
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, group), x509.NameAttribute(NameOID.COMMON_NAME, user)]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=2))
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    crt, pem = workdir / f"{user}.crt", workdir / f"{user}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return kubeconfig_for(
        cluster, workdir / f"{user}.kubeconfig", {"client-certificate": str(crt), "client-key": str(pem)}
    )


def _tenant(name: str, namespaces: list[str], quota: int, group: str, **extra) -> str:
    spec = {
        "namespaces": namespaces,
        "gpuQuota": {"h100": quota},
        "pricePerGPUHour": {"h100": 3.6},
        "members": [{"kind": "Group", "name": group}],
        **extra,
    }
    return manifest_yaml.dump(
        {"apiVersion": "flotilla.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": name}, "spec": spec}
    )


def _isvc(name: str, replicas: int = 1, gpus: int = 1, gpu_type: str = "h100", **spec) -> str:
    body = {
        "model": {"uri": f"file://{MODEL_DIR}", "servedName": "tiny"},
        "resources": {"gpus": gpus, "gpuType": gpu_type},
        "replicas": replicas,
        **spec,
    }
    return manifest_yaml.dump(
        {
            "apiVersion": "flotilla.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": body,
        }
    )


def _as(cluster: ClusterHandle, kubeconfig: Path, *args: str, input: str | None = None):
    """kubectl as another identity (the handle's kubectl is the admin)."""
    from flotilla.cluster.control_plane import kubectl_path

    return subprocess.run(
        [str(kubectl_path()), f"--kubeconfig={kubeconfig}", *args],
        capture_output=True, text=True, input=input, timeout=60,
    )  # fmt: skip


class Env:
    def __init__(self, cluster, operator, workdir, webhook_port: int):
        self.cluster, self.operator, self.workdir = cluster, operator, workdir
        self.webhook_port = webhook_port
        self.tenant_a, self.tenant_b = f"team-a-{RUN}", f"team-b-{RUN}"
        self.ns_a, self.ns_b = f"ta-{RUN}", f"tb-{RUN}"
        self.alice = _user_kubeconfig(cluster, workdir, f"alice-{RUN}", f"devs-a-{RUN}")
        self.bob = _user_kubeconfig(cluster, workdir, f"bob-{RUN}", f"devs-b-{RUN}")


@pytest.fixture(scope="module")
def env(cluster: ClusterHandle, tmp_path_factory):
    install_manifests(cluster)
    workdir = tmp_path_factory.mktemp("tenancy")
    MODEL_DIR.mkdir(exist_ok=True)
    webhook_port = free_port()
    operator = OperatorProcess(
        service_account_kubeconfig(cluster, workdir / "operator.kubeconfig"),
        workdir / "operator.log",
        ("--webhook-port", str(webhook_port), "--metering-interval", str(METERING_INTERVAL)),
        host_path_roots=(MODEL_DIR,),
    )
    e = Env(cluster, operator, workdir, webhook_port)
    for ns in (e.ns_a, e.ns_b):
        cluster.kubectl("create", "namespace", ns)
    operator.start()
    try:
        # The webhook is live once kopf has registered it and answers: a tenantless create is refused.
        wait_for(
            lambda: (
                "belongs to no tenant"
                in cluster.kubectl(
                    "apply", "-n", e.ns_a, "--dry-run=server", "-f", "-", input=_isvc("probe"), check=False
                ).stderr
            ),
            60,
            "the admission webhook to answer",
        )
        cluster.apply(_tenant(e.tenant_a, [e.ns_a], 2, f"devs-a-{RUN}", maxServices=3))
        cluster.apply(_tenant(e.tenant_b, [e.ns_b], 2, f"devs-b-{RUN}"))
        yield e
    finally:
        operator.stop()
        cluster.kubectl("delete", "validatingwebhookconfiguration", WEBHOOK_CONFIG, "--ignore-not-found")
        # Its TLS Secret too: a chart installed by a later module makes its own.
        cluster.kubectl(
            "delete", "secret", "flotilla-webhook-tls", "-n", OPERATOR_NS, "--ignore-not-found", check=False
        )
        for ns in (e.ns_a, e.ns_b):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl(
            "delete", "tenant", e.tenant_a, e.tenant_b, "--ignore-not-found", "--wait=false", check=False
        )
        MODEL_DIR.rmdir()


def _webhook(cluster: ClusterHandle) -> dict:
    return cluster.get_json("validatingwebhookconfiguration", WEBHOOK_CONFIG)


# ---------------------------------------------------------------------------------------------------


def test_webhook_is_tls_from_a_ca_in_a_secret_with_fail_policy(env):
    config = _webhook(env.cluster)
    secret = env.cluster.get_json("secret", "flotilla-webhook-tls", "-n", OPERATOR_NS)
    assert set(secret["data"]) >= {"ca.crt", "tls.crt", "tls.key"}
    hooks = config["webhooks"]
    assert hooks and all(h["failurePolicy"] == "Fail" for h in hooks)
    for hook in hooks:
        assert hook["clientConfig"]["url"].startswith(f"https://127.0.0.1:{env.webhook_port}/")
        assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    resources = {r for h in hooks for rule in h["rules"] for r in rule["resources"]}
    assert resources >= {"inferenceservices", "inferenceservices/scale", "tenants"}


def test_over_quota_apply_is_refused_with_the_full_message(env):
    c, ns, tenant = env.cluster, env.ns_a, env.tenant_a
    c.apply(_isvc("chat", replicas=2), ns)
    refused = c.kubectl("apply", "-n", ns, "-f", "-", input=_isvc("extra", replicas=1), check=False)
    assert refused.returncode != 0
    for words in (f"tenant {tenant}", f"{ns}/extra", "replicas 1 x 1 h100 GPUs = 1 h100 GPUs",
                  "h100 quota is 2", "2 are in use", f"{ns}/chat: 2", "0 remain"):  # fmt: skip
        assert words in refused.stderr, refused.stderr

    # An autoscaled service is charged maxReplicas x gpus, whatever it runs now.
    auto = _isvc("auto", replicas=1, autoscaling={"minReplicas": 1, "maxReplicas": 3})
    c.kubectl("scale", "fisvc", "chat", "-n", ns, "--replicas", "0")
    refused = c.kubectl("apply", "-n", ns, "-f", "-", input=auto, check=False)
    assert "maxReplicas 3 x 1 h100 GPUs = 3 h100 GPUs" in refused.stderr, refused.stderr
    # kubectl scale goes through the scale subresource, and is charged the same way.
    refused = c.kubectl("scale", "fisvc", "chat", "-n", ns, "--replicas", "3", check=False)
    assert refused.returncode != 0 and "h100 quota is 2" in refused.stderr, refused.stderr
    c.kubectl("scale", "fisvc", "chat", "-n", ns, "--replicas", "2")

    other_type = c.kubectl("apply", "-n", ns, "-f", "-", input=_isvc("a100", gpu_type="a100"), check=False)
    assert "GPU type 'a100'" in other_type.stderr and "h100 (limit 2)" in other_type.stderr, other_type.stderr
    c.kubectl("create", "namespace", f"nobody-{RUN}")
    try:
        orphan = c.kubectl("apply", "-n", f"nobody-{RUN}", "-f", "-", input=_isvc("x"), check=False)
        assert f"namespace nobody-{RUN} belongs to no tenant" in orphan.stderr, orphan.stderr
    finally:
        c.kubectl("delete", "namespace", f"nobody-{RUN}", "--wait=false")


def test_what_the_reconciler_would_mark_invalid_is_refused_in_its_words(env):
    c, ns = env.cluster, env.ns_a
    bad = _isvc("min-over-max", replicas=1, autoscaling={"minReplicas": 3, "maxReplicas": 2})
    refused = c.kubectl("apply", "-n", ns, "-f", "-", input=bad, check=False)
    assert refused.returncode != 0
    # The Valid condition's message (tests/operator/test_admission.py checks that they are the same).
    assert "spec.autoscaling: minReplicas (3) is greater than maxReplicas (2)" in refused.stderr, (
        refused.stderr
    )
    # Nothing stored, so nothing charged.
    assert c.kubectl("get", "fisvc", "min-over-max", "-n", ns, check=False).returncode != 0


def test_parallel_applies_cannot_both_pass_into_over_quota(env, cluster):
    tenant, ns = f"race-{RUN}", f"race-{RUN}"
    cluster.kubectl("create", "namespace", ns)
    cluster.apply(_tenant(tenant, [ns], 2, f"race-{RUN}"))
    try:

        def apply(i: int) -> bool:
            manifest = _isvc(f"r{i}", replicas=1)
            return cluster.kubectl("apply", "-n", ns, "-f", "-", input=manifest, check=False).returncode == 0

        with ThreadPoolExecutor(max_workers=6) as pool:
            results = list(pool.map(apply, range(6)))
        stored = cluster.get_json("fisvc", "-n", ns)["items"]
        assert sum(results) == 2 and len(stored) == 2, (results, [s["metadata"]["name"] for s in stored])
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false")
        cluster.kubectl("delete", "tenant", tenant, "--wait=false")


def test_bad_tenants_are_refused(env, cluster):
    taken = cluster.kubectl(
        "apply", "-f", "-", input=_tenant(f"thief-{RUN}", [env.ns_a], 1, "x"), check=False
    )
    assert taken.returncode != 0
    assert f"namespace {env.ns_a} already belongs to tenant {env.tenant_a}" in taken.stderr, taken.stderr
    negative = cluster.kubectl(
        "apply", "-f", "-", input=_tenant(f"neg-{RUN}", [f"neg-{RUN}"], -1, "x"), check=False
    )
    assert negative.returncode != 0 and "spec.gpuQuota.h100" in negative.stderr, negative.stderr


def test_a_namespace_joins_a_tenant_by_label_and_its_quota_holds(env, cluster):
    tenant, ns = f"sel-{RUN}", f"sel-{RUN}"
    cluster.kubectl("create", "namespace", ns)
    try:
        selector = {"matchLabels": {"flotilla.dev/test-team": RUN}}
        cluster.apply(_tenant(tenant, [], 1, f"devs-sel-{RUN}", namespaceSelector=selector))
        orphan = cluster.kubectl("apply", "-n", ns, "-f", "-", input=_isvc("sel"), check=False)
        assert orphan.returncode != 0 and "belongs to no tenant" in orphan.stderr, orphan.stderr

        cluster.kubectl("label", "namespace", ns, f"flotilla.dev/test-team={RUN}")
        wait_for(
            lambda: (
                cluster.kubectl("apply", "-n", ns, "-f", "-", input=_isvc("sel"), check=False).returncode == 0
            ),
            30,
            "the webhook to see the label",
        )
        pods = wait_for(lambda: _pods(cluster, ns), 60, "the service's pod")
        env_vars = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}
        assert env_vars["FLOTILLA_TENANT"] == tenant  # the reconciler charged the selecting tenant
        over = cluster.kubectl("apply", "-n", ns, "-f", "-", input=_isvc("sel-2"), check=False)
        assert over.returncode != 0 and f"tenant {tenant}" in over.stderr and "h100 quota is 1" in over.stderr
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "tenant", tenant, "--ignore-not-found", "--wait=false", check=False)


def test_members_are_isolated_in_both_directions(env, cluster):
    pairs = [
        (env.alice, env.ns_a, env.tenant_a, env.ns_b, env.tenant_b),
        (env.bob, env.ns_b, env.tenant_b, env.ns_a, env.tenant_a),
    ]
    # The operator derives RoleBindings from members; wait until they exist.
    for _, ns, tenant, _, _ in pairs:
        wait_for(lambda ns=ns, tenant=tenant: cluster.kubectl("get", "rolebinding", f"flotilla-tenant-{tenant}", "-n", ns, check=False).returncode == 0,
                 60, f"the RoleBinding in {ns}")  # fmt: skip
    for who, own_ns, own, other_ns, other in pairs:
        ok = _as(cluster, who, "apply", "-n", own_ns, "-f", "-", input=_isvc("mine", replicas=0))
        assert ok.returncode == 0, ok.stderr
        assert _as(cluster, who, "get", "fisvc", "-n", own_ns).returncode == 0
        assert _as(cluster, who, "get", "pods", "-n", own_ns).returncode == 0
        assert _as(cluster, who, "get", "tenant", own).returncode == 0
        for args in (("get", "fisvc", "-n", other_ns), ("get", "fisvc", "chat", "-n", other_ns),
                     ("patch", "fisvc", "mine", "-n", other_ns, "--type=merge", "-p", '{"spec":{"replicas":1}}'),
                     ("get", "tenant", other),
                     ("patch", "tenant", own, "--type=merge", "-p", '{"spec":{"gpuQuota":{"h100":100}}}'),
                     ("get", "pods", "-n", other_ns)):  # fmt: skip
            result = _as(cluster, who, *args)
            assert result.returncode != 0 and "forbidden" in result.stderr.lower(), (args, result.stderr)
        pod = {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sneaky"},
            "spec": {"containers": [{"name": "c", "image": "x", "command": ["sleep", "1"],
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        }  # fmt: skip
        direct = _as(cluster, who, "apply", "-n", own_ns, "-f", "-", input=manifest_yaml.dump(pod))
        assert direct.returncode != 0 and "forbidden" in direct.stderr.lower(), direct.stderr
        cluster.kubectl("delete", "fisvc", "mine", "-n", own_ns)


def test_resource_quota_backstops_gpu_pods_from_anyone(env, cluster):
    quota = wait_for(lambda: cluster.kubectl("get", "resourcequota", f"flotilla-tenant-{env.tenant_b}", "-n", env.ns_b, "-o", "json", check=False).stdout,
                     60, "the ResourceQuota")  # fmt: skip
    assert json.loads(quota)["spec"]["hard"] == {"requests.nvidia.com/gpu": "2"}
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "big"},
        "spec": {"containers": [{"name": "c", "image": "x", "command": ["sleep", "1"],
                                 "resources": {"limits": {"nvidia.com/gpu": "3"}}}]},
    }  # fmt: skip
    result = wait_for(
        lambda: (
            (
                r := cluster.kubectl(
                    "apply", "-n", env.ns_b, "-f", "-", input=manifest_yaml.dump(pod), check=False
                )
            ).returncode
            and r
        ),
        30,
        "the admin's 3-GPU pod to be refused by the ResourceQuota",
    )
    assert "exceeded quota" in result.stderr, result.stderr


def _pods(cluster, namespace) -> list[dict]:
    return cluster.get_json("pods", "-n", namespace)["items"]


def _bound_pods(cluster, namespace: str, count: int) -> list[dict] | None:
    """The namespace's pods once exactly `count` of them are bound to nodes."""
    bound = [p for p in _pods(cluster, namespace) if p["spec"].get("nodeName")]
    return bound if len(bound) == count else None


def _scheduled(pod: dict) -> float:
    cond = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
    return dt.datetime.fromisoformat(cond["lastTransitionTime"].replace("Z", "+00:00")).timestamp()


def _exact_gpu_seconds(pods: list[dict], until: str) -> float:
    end = dt.datetime.fromisoformat(until.replace("Z", "+00:00")).timestamp()
    return sum(end - _scheduled(p) for p in pods)  # one GPU per pod


def _usage(env, *args: str) -> subprocess.CompletedProcess:
    """`flotilla usage` as a tenant member (alice may get only her own Tenant)."""
    return subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "usage", *args, "--kubeconfig", str(env.alice)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_metering_survives_killed_operators_and_matches_pod_lifetimes(env, cluster):
    ns, tenant = env.ns_a, env.tenant_a
    cluster.kubectl("scale", "fisvc", "chat", "-n", ns, "--replicas", "0")
    wait_for(lambda: not _pods(cluster, ns), 90, "chat's old pods to go")
    cluster.apply(_isvc("metered", replicas=2), ns)
    pods = wait_for(lambda: _bound_pods(cluster, ns, 2), 90, "2 bound pods")
    for _ in range(3):
        time.sleep(METERING_INTERVAL * 1.5)
        env.operator.stop(signal.SIGKILL)
        env.operator.start()
    before = cluster.get_json("tenant", tenant)["status"]["lastMeteredTime"]
    status = wait_for(
        lambda: _status_if_metered_since(cluster, tenant, before),
        30,
        "a metering round by the restarted operator",
    )
    assert {p["metadata"]["uid"] for p in _pods(cluster, ns)} == {p["metadata"]["uid"] for p in pods}
    exact = _exact_gpu_seconds(pods, status["lastMeteredTime"])
    metered = status["usage"]["total"]["byService"][f"{ns}/metered"]
    # PodScheduled times have whole seconds: up to one second per pod on top of the interval.
    tolerance = METERING_INTERVAL + len(pods)
    assert abs(metered - exact) <= tolerance, (metered, exact)
    assert status["gpusAllocated"] == {"h100": 2} and status["gpuQuota"] == {"h100": 2}
    assert status["cost"] == pytest.approx(status["usage"]["total"]["total"] / 3600 * 3.6, rel=1e-3)

    report = _usage(env, "--tenant", tenant, "--format", "json")
    assert report.returncode == 0, report.stderr
    (tenant_report,) = json.loads(report.stdout)["tenants"]
    (row,) = [r for r in tenant_report["rows"] if r["service"] == "metered"]
    exact = _exact_gpu_seconds(pods, tenant_report["last_metered_time"])
    assert abs(row["gpu_seconds"] - exact) <= tolerance, (row, exact)
    table = _usage(env, "--tenant", tenant)
    assert "GPU SECONDS" in table.stdout and "metered" in table.stdout, table.stdout
    assert _usage(env, "--tenant", env.tenant_b).returncode != 0  # not alice's tenant

    metrics = wait_for(
        lambda: (m := env.operator.get("/metrics")[1]) and f'tenant="{tenant}"' in m and m,
        30,
        "tenant series",
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    h100 = (("gpu_type", "h100"), ("tenant", tenant))
    assert samples[("flotilla_tenant_gpu_quota", h100)] == 2
    assert samples[("flotilla_tenant_gpus_allocated", h100)] == 2
    key = (("gpu_type", "h100"), ("namespace", ns), ("service", "metered"), ("tenant", tenant))
    assert samples[("flotilla_tenant_gpu_seconds_total", key)] >= metered


def _time(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _finished(pod: dict) -> float | None:
    ends = [
        _time(t)
        for s in pod["status"].get("containerStatuses") or []
        if (t := ((s.get("state") or {}).get("terminated") or {}).get("finishedAt"))
    ]
    return max(ends) if ends else None


def test_a_pod_that_ends_while_no_operator_runs_is_metered_to_its_end(env, cluster):
    """The operator is SIGKILLed; while it is down an admin deletes the engine pod (its ReplicaSet makes
    another at once). The pod's metering finalizer keeps it in the API with its end recorded by the node,
    and the next operator meters it to that end, exactly (it once lost the whole outage)."""
    ns, tenant, name = env.ns_b, env.tenant_b, "ended"
    cluster.apply(_isvc(name, replicas=1), ns)

    def bound_with_finalizer() -> list[dict] | None:
        bound = [p for p in _bound_pods(cluster, ns, 1) or [] if p["metadata"]["name"].startswith(name)]
        held = [p for p in bound if METERING_FINALIZER in (p["metadata"].get("finalizers") or [])]
        return held or None

    held = wait_for(bound_with_finalizer, 90, "a bound engine pod that carries the metering finalizer")
    assert held is not None
    (pod,) = held
    uid = pod["metadata"]["uid"]
    bound_at = _scheduled(pod)
    wait_for(
        lambda: _time(cluster.get_json("tenant", tenant)["status"]["lastMeteredTime"]) > bound_at,
        30,
        "a metering round that saw the pod",
    )
    env.operator.stop(signal.SIGKILL)
    try:
        # An outage long enough that a lost span could not hide in the tolerance.
        last = _time(cluster.get_json("tenant", tenant)["status"]["lastMeteredTime"])
        wait_for(lambda: time.time() - last >= 5, 30, "five seconds of outage since the last round")
        cluster.kubectl("delete", "pod", pod["metadata"]["name"], "-n", ns, "--wait=false")
        ended = wait_for(
            lambda: next(
                (
                    p
                    for p in _pods(cluster, ns)
                    if p["metadata"]["uid"] == uid and p["metadata"].get("deletionGracePeriodSeconds") == 0
                ),
                None,
            ),
            60,
            "the node to stop the pod and let it go (the finalizer keeps it in the API)",
        )
    finally:
        env.operator.start()
    # The node's record of its end: the container's finishedAt, or (an engine that was not running, as
    # here where the model folder is empty) the deletion it acted on.
    end = _finished(ended) or _time(ended["metadata"]["deletionTimestamp"])
    assert end > last + 4
    wait_for(lambda: all(p["metadata"]["uid"] != uid for p in _pods(cluster, ns)), 60, "the pod let go")
    restarted = cluster.get_json("tenant", tenant)["status"]["lastMeteredTime"]
    status = wait_for(
        lambda: _status_if_metered_since(cluster, tenant, restarted), 30, "a round after release"
    )
    # The replacement the ReplicaSet made during the outage counts too, from its own binding.
    others = [
        p for p in _pods(cluster, ns) if p["metadata"]["name"].startswith(name) and p["spec"].get("nodeName")
    ]
    until = _time(status["lastMeteredTime"])
    exact = (end - bound_at) + sum(max(0.0, until - _scheduled(p)) for p in others)
    metered = status["usage"]["total"]["byService"][f"{ns}/{name}"]
    print(f"\nmetered {metered:.2f} GPU-s, spans {exact:.2f} (pod ended {end - last:.1f}s into the outage)")
    # Whole-second timestamps: up to one second per pod.
    assert abs(metered - exact) <= 1.0 * (1 + len(others)), (metered, exact)
    # Never counted twice: a later round adds only what still runs.
    later = wait_for(
        lambda: _status_if_metered_since(cluster, tenant, status["lastMeteredTime"]), 30, "one more round"
    )
    grown = later["usage"]["total"]["byService"][f"{ns}/{name}"] - metered
    running = len(others) * (_time(later["lastMeteredTime"]) - until)
    assert abs(grown - running) <= 1.0 * max(1, len(others)), (grown, running)
    cluster.kubectl("delete", "inferenceservice", name, "-n", ns, "--wait=false")


def test_a_webhook_without_its_namespace_exits_at_once_with_one_line(cluster, tmp_path):
    """Without the namespace for its TLS Secret, the operator used to retry its start-up forever (a
    traceback a minute, nothing reconciled). It must say what is missing, once, and exit."""
    install_manifests(cluster)  # the operator's ServiceAccount, which may read namespaces
    missing = f"missing-{RUN}"
    assert cluster.kubectl("get", "namespace", missing, check=False).returncode != 0
    operator = OperatorProcess(
        service_account_kubeconfig(cluster, tmp_path / "operator.kubeconfig"),
        tmp_path / "operator.log",
        ("--webhook-port", str(free_port()), "--operator-namespace", missing),
    )
    result = subprocess.run(operator.argv(), capture_output=True, text=True, timeout=60)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode != 0, output
    assert len(output.splitlines()) == 1 and "Traceback" not in output, output
    assert f"namespace {missing} does not exist" in output, output
    assert "kubectl apply -f deploy/operator-rbac.yaml" in output, output


def _status_if_metered_since(cluster: ClusterHandle, tenant: str, before: str) -> dict | None:
    """The Tenant's status once a metering round after `before` has written it."""
    status = cluster.get_json("tenant", tenant)["status"]
    return status if status["lastMeteredTime"] != before else None
