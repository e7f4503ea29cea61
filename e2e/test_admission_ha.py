"""Quota at admission with 1, 2 and 3 operator replicas, installed by the chart: bursts of concurrent
creates and raises (merge patch, JSON patch, server-side apply, `kubectl scale`) from several clients
at once, and the active replica force-deleted in the middle of a burst.

The API server spreads reviews over every Ready operator pod (the node agent forwards the webhook's
NodePort round-robin, as kube-proxy would), so each burst is answered by all replicas. What is asserted is
what the API stored afterwards: the sum of the stored specs' GPUs never passes the quota, and every
request that fitted was admitted (exactly the quota is taken). Engine pods are kept from starting by a
ResourceQuota of zero pods in the test namespaces: admission is what is under test, and nine engines
would only load the machine.
"""

from __future__ import annotations

import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle, wait_for
from flotilla.cluster.helm import helm
from flotilla.operator.api.conditions import is_ready
from flotilla.operator.cmd.local import inference_service, tiny_model
from flotilla.operator.cmd.local_chart import (
    CHART_DIR,
    NAMESPACE,
    RELEASE,
    free_node_port,
    install,
    local_values,
    operator_pods,
)

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]
RUN = uuid.uuid4().hex[:5]
MODEL_DIR = Path(f"/tmp/flotilla-ha-model-{RUN}")
WEBHOOK = "flotilla-webhook"
QUOTA = 3
BURST = 8
REPORT: list[str] = []  # printed at the end: the figures for the closing note


@pytest.fixture(scope="module")
def chart(cluster: ClusterHandle):
    tiny_model(MODEL_DIR)
    node_port = free_node_port()
    # The API server's longest webhook wait: correctness under contention is under test here, not how fast
    # a busy two-core machine answers eight racing reviews.
    values = lambda replicas: local_values(  # noqa: E731
        node_port, (MODEL_DIR,), operator__replicas=replicas, webhook__timeoutSeconds=30
    )
    try:
        yield lambda replicas: _scale_operator(cluster, values(replicas), replicas)
    finally:
        helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", kubeconfig=cluster.kubeconfig, check=False)
        cluster.kubectl("delete", "validatingwebhookconfiguration", WEBHOOK, "--ignore-not-found")
        print("\n".join(["", "admission under bursts (closing-note figures):", *REPORT]))


def _scale_operator(cluster: ClusterHandle, values: dict, replicas: int) -> None:
    install(cluster, values, chart=ROOT / CHART_DIR)
    wait_for(
        lambda: len([p for p in operator_pods(cluster) if is_ready(p)]) == replicas,
        180,
        f"{replicas} Ready operator pods",
    )


def _tenant_and_namespace(cluster: ClusterHandle, label: str) -> tuple[str, str]:
    tenant, ns = f"ha-{label}-{RUN}", f"ha-{label}-{RUN}"
    cluster.kubectl("create", "namespace", ns)
    # Zero pods: the services' Deployments may not start engines here (admission is what is tested).
    cluster.kubectl("create", "quota", "no-engines", "-n", ns, "--hard=pods=0")
    spec = {"namespaces": [ns], "gpuQuota": {"h100": QUOTA}}
    body = {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": tenant},
        "spec": spec,
    }
    wait_for(
        lambda: (
            cluster.kubectl("apply", "-f", "-", input=manifest_yaml.dump(body), check=False).returncode == 0
        ),
        60,
        f"Tenant {tenant} admitted",
    )
    return tenant, ns


def _stored_gpus(cluster: ClusterHandle, ns: str) -> dict[str, int]:
    items = cluster.get_json("inferenceservices", "-n", ns)["items"]
    return {i["metadata"]["name"]: i["spec"]["replicas"] * i["spec"]["resources"]["gpus"] for i in items}


def _isvc(name: str, replicas: int) -> str:
    return manifest_yaml.dump(inference_service(name, MODEL_DIR, replicas=replicas))


def _outcome(result) -> str:
    if result.returncode == 0:
        return "admitted"
    if "denied the request" in result.stderr and "quota" in result.stderr:
        return "refused"
    return "failed"  # the webhook could not be called (a replica killed), or another error


def _burst(actions, kill=None) -> list[tuple[str, str]]:
    """Runs the actions at once (each returns a CompletedProcess); `kill` runs when half have started."""
    started, results = threading.Barrier(BURST + (1 if kill else 0)), []

    def run(action):
        started.wait()
        return action()

    with ThreadPoolExecutor(BURST + 1) as pool:
        futures = [pool.submit(run, a) for a in actions]
        if kill:
            started.wait()
            kill()
        for future in futures:
            result = future.result()
            results.append((_outcome(result), result.stderr.strip()[-300:]))
    return results


def _raises(cluster: ClusterHandle, ns: str, names: list[str]):
    """Eight ways to take one more GPU, one per service: each service goes from 0 replicas to 1."""
    forms = [
        lambda n: cluster.kubectl("scale", "inferenceservice", n, "-n", ns, "--replicas=1", check=False),
        lambda n: cluster.kubectl("patch", "inferenceservice", n, "-n", ns, "--type=merge",
                                  "-p", json.dumps({"spec": {"replicas": 1}}), check=False),
        lambda n: cluster.kubectl("patch", "inferenceservice", n, "-n", ns, "--type=json",
                                  "-p", json.dumps([{"op": "replace", "path": "/spec/replicas", "value": 1}]),
                                  check=False),
        lambda n: cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=burst",
                                  "-n", ns, "-f", "-", input=_isvc(n, 1), check=False),
    ]  # fmt: skip
    return [lambda n=n, form=forms[i % len(forms)]: form(n) for i, n in enumerate(names)]


def _check(label: str, replicas: int, cluster: ClusterHandle, ns: str, results, *, killed: bool) -> None:
    stored = _stored_gpus(cluster, ns)
    held = sum(stored.values())
    counts = {k: sum(1 for o, _ in results if o == k) for k in ("admitted", "refused", "failed")}
    REPORT.append(
        f"  replicas={replicas} {label}: {BURST} requests, admitted {counts['admitted']}, refused "
        f"{counts['refused']}, failed to reach a webhook {counts['failed']}; stored {held} of {QUOTA} GPUs"
    )
    assert held <= QUOTA, (stored, results)
    if not killed:
        # Without a fault every request reached a webhook, and every one that fitted was admitted.
        assert counts["failed"] == 0, [e for o, e in results if o == "failed"][:3]
        assert held == QUOTA and counts["admitted"] == QUOTA, (stored, results)
    else:
        assert counts["refused"] + counts["failed"] >= BURST - QUOTA


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_bursts_never_store_more_than_the_quota(chart, cluster: ClusterHandle, replicas: int):
    chart(replicas)

    # Creates: eight one-GPU services at once.
    _, ns = _tenant_and_namespace(cluster, f"c{replicas}")
    creates = [
        lambda i=i: cluster.kubectl("create", "-n", ns, "-f", "-", input=_isvc(f"s{i}", 1), check=False)
        for i in range(BURST)
    ]
    _check("creates", replicas, cluster, ns, _burst(creates), killed=False)

    # Raises: eight services stored at 0 replicas (charged nothing), then each raised to one at once.
    _, ns = _tenant_and_namespace(cluster, f"r{replicas}")
    names = [f"s{i}" for i in range(BURST)]
    for name in names:
        cluster.kubectl("create", "-n", ns, "-f", "-", input=_isvc(name, 0))
    _check("raises", replicas, cluster, ns, _burst(_raises(cluster, ns, names)), killed=False)


def test_the_active_replica_killed_in_a_burst(chart, cluster: ClusterHandle):
    chart(2)
    _, ns = _tenant_and_namespace(cluster, "kill")
    active = max(operator_pods(cluster), key=lambda p: p["metadata"]["creationTimestamp"])
    name = active["metadata"]["name"]

    def kill() -> None:
        cluster.kubectl("delete", "pod", name, "-n", NAMESPACE, "--grace-period=0", "--force", check=False)

    creates = [
        lambda i=i: cluster.kubectl("create", "-n", ns, "-f", "-", input=_isvc(f"s{i}", 1), check=False)
        for i in range(BURST)
    ]
    _check("creates, active replica force-deleted", 2, cluster, ns, _burst(creates, kill=kill), killed=True)

    # Until the quota is full, a create that fits is admitted again soon after the fault (by the
    # surviving replica at once, or the replacement): wait for that, and the sum still holds.
    def fill() -> bool:
        free = QUOTA - sum(_stored_gpus(cluster, ns).values())
        if free == 0:
            return True
        cluster.kubectl(
            "create", "-n", ns, "-f", "-", input=_isvc(f"late-{uuid.uuid4().hex[:4]}", 1), check=False
        )
        return False

    wait_for(fill, 60, "creates that fit to be admitted after the fault")
    assert sum(_stored_gpus(cluster, ns).values()) == QUOTA
    refusal = cluster.kubectl("create", "-n", ns, "-f", "-", input=_isvc("one-more", 1), check=False)
    assert _outcome(refusal) == "refused", refusal.stderr


def _raw_gpu_pod(name: str) -> str:
    """A GPU pod Flotilla did not make (an admin's), bound to a node that runs nothing: it counts against
    the namespace's ResourceQuota as any pending pod does, without starting a process."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": "no-such-node",
            "containers": [
                {"name": "c", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ],
        },
    }
    return manifest_yaml.dump(pod)


def test_the_backstop_holds_the_total_across_namespaces_and_creators(chart, cluster: ClusterHandle):
    """A Tenant with quota 2 over two namespaces: the admin creates two raw GPU pods in each at once.
    The API server itself must refuse past 2 in total (it once held 4)."""
    chart(1)
    tenant = f"ha-backstop-{RUN}"
    namespaces = [f"ha-bs-a-{RUN}", f"ha-bs-b-{RUN}"]
    for ns in namespaces:
        cluster.kubectl("create", "namespace", ns)
    spec = {"namespaces": namespaces, "gpuQuota": {"h100": 2}}
    body = {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "Tenant",
        "metadata": {"name": tenant},
        "spec": spec,
    }
    cluster.kubectl("apply", "-f", "-", input=manifest_yaml.dump(body))

    def limits() -> dict[str, int]:
        found = {}
        for ns in namespaces:
            quotas = cluster.get_json("resourcequota", "-n", ns, "-l", f"flotilla.dev/tenant={tenant}")[
                "items"
            ]
            for quota in quotas:
                found[ns] = int(quota["spec"]["hard"]["requests.nvidia.com/gpu"])
        return found

    wait_for(lambda: len(limits()) == 2, 120, "the backstop's ResourceQuota in both namespaces")
    assert sum(limits().values()) == 2, limits()

    creates = [
        lambda ns=ns, i=i: cluster.kubectl(
            "create", "-n", ns, "-f", "-", input=_raw_gpu_pod(f"raw-{i}"), check=False
        )
        for ns in namespaces
        for i in range(2)
    ]
    with ThreadPoolExecutor(len(creates)) as pool:
        results = list(pool.map(lambda create: create(), creates))
    refused = [r.stderr for r in results if r.returncode != 0]
    held = sum(len(cluster.get_json("pods", "-n", ns)["items"]) for ns in namespaces)
    REPORT.append(f"  backstop: 4 raw GPU pods over 2 namespaces against a quota of 2: stored {held}")
    assert held <= 2, (held, refused)
    assert all("exceeded quota" in e for e in refused), refused
    for ns in namespaces:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    cluster.kubectl("delete", "tenant", tenant, "--wait=false", check=False)


def test_tenants_applied_at_once_never_share_a_namespace(chart, cluster: ClusterHandle):
    """Six Tenants that claim one namespace (by name, or by its label) are applied at once and answered by
    two replicas: exactly one is admitted, the others are refused naming the namespace."""
    chart(2)
    ns = f"ha-contest-{RUN}"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("label", "namespace", ns, f"contest={RUN}")
    names = [f"ha-claim-{i}-{RUN}" for i in range(6)]

    def tenant(i: int) -> str:
        claim = {"namespaces": [ns]} if i % 2 else {"namespaceSelector": {"matchLabels": {"contest": RUN}}}
        body = {"apiVersion": "flotilla.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": names[i]},
                "spec": {**claim, "gpuQuota": {"h100": 1}}}  # fmt: skip
        return manifest_yaml.dump(body)

    creates = [
        lambda i=i: cluster.kubectl("create", "-f", "-", input=tenant(i), check=False) for i in range(6)
    ]
    with ThreadPoolExecutor(len(creates)) as pool:
        results = list(pool.map(lambda create: create(), creates))
    admitted = [n for n, r in zip(names, results, strict=True) if r.returncode == 0]
    refused = [r.stderr for r in results if r.returncode != 0]
    stored = [n for n in names if cluster.kubectl("get", "tenant", n, check=False).returncode == 0]
    REPORT.append(
        f"  6 Tenants claiming one namespace at once: admitted {len(admitted)}, stored {len(stored)}"
    )
    assert len(admitted) == 1 and stored == admitted, (admitted, stored, refused)
    assert all(f"namespace {ns} already belongs to tenant" in e for e in refused), refused
    cluster.kubectl("delete", "tenant", *stored, "--wait=false", check=False)
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
