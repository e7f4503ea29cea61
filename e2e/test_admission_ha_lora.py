"""A Tenant's maxLoRAAdapters at admission with three operator replicas: bursts of concurrent LoRAAdapter
creates against a limit of three, answered by every replica at once, then a delete and a second burst.

The replicas are `flotilla operator run` processes (this checkout's code, under the operator's
ServiceAccount) with kopf peering, as the chart runs its pods: one is active, the others stand by, and
all of them answer reviews. The API server reaches them through the node agent's own NodePort forwarder
(flotilla.cluster.node_ports, round robin per connection, as kube-proxy would), at the address of a
ValidatingWebhookConfiguration written here from the operator's own webhook definitions, as the chart
writes it. What is asserted is what the API stored: exactly the limit, each refusal a 403 naming the
tenant, the count and the limit; and after one adapter is deleted, its reservation is gone from the
tenant's ledger and exactly one more create of a burst is admitted.
"""

from __future__ import annotations

import re
import socket
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle, free_port, wait_for
from flotilla.cluster.kubeclient import ApiError, KubeClient
from flotilla.cluster.node_ports import NodePortProxy
from flotilla.operator.clients.quota_ledger import reservations_name
from flotilla.operator.cmd.local import (
    OPERATOR_NS,
    OperatorProcess,
    install_manifests,
    service_account_kubeconfig,
)
from flotilla.operator.controllers.webhook_reviews import webhook_definitions
from flotilla.operator.controllers.webhook_tls import SECRET_NAME as WEBHOOK_TLS_SECRET
from flotilla.operator.tenancy.reservations import adapter_data_key

pytestmark = pytest.mark.cluster

RUN = uuid.uuid4().hex[:5]
REPLICAS = 3
LIMIT = 3
BURST = 8
ROUNDS = 3
WEBHOOK_CONFIG = f"flotilla-ha-lora-{RUN}"
PEERING = f"ha-lora-{RUN}"
ADAPTERS = "/apis/flotilla.dev/v1alpha1/namespaces/{ns}/loraadapters"
REPORT: list[str] = []  # printed at the end: the figures for the closing note


@dataclass
class Replicas:
    operators: list[OperatorProcess]
    client: KubeClient  # the admin's, for bursts from threads


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def _forwarder(ports: list[int], node_port: int) -> NodePortProxy:
    """The node agent's NodePort forwarder, in this process, for a Service whose endpoints are the
    replicas' webhook ports on the host (each a `pod` with one named container port)."""
    endpoints = [
        ({"spec": {"containers": [{"name": "operator", "ports": [{"name": "webhook", "containerPort": p}]}]}},
         "127.0.0.1")
        for p in ports
    ]  # fmt: skip
    proxy = NodePortProxy("127.0.0.1", lambda _ns, _selector: endpoints)
    service = {
        "metadata": {"namespace": OPERATOR_NS, "name": "flotilla-webhook"},
        "spec": {
            "type": "NodePort",
            "selector": {"app": "flotilla-operator"},
            "ports": [{"port": 443, "nodePort": node_port, "targetPort": "webhook"}],
        },
    }
    proxy.sync([service])
    assert node_port in proxy.listeners, f"could not listen on 127.0.0.1:{node_port}"
    return proxy


def _webhook_configuration(cluster: ClusterHandle, node_port: int) -> dict:
    """What the chart writes (templates/webhook.yaml), for a webhook URL on the host."""
    ca = cluster.get_json("secret", WEBHOOK_TLS_SECRET, "-n", OPERATOR_NS)["data"]["ca.crt"]
    hooks = []
    for hook in webhook_definitions():
        path = hook.pop("path")
        client_config = {"url": f"https://127.0.0.1:{node_port}{path}", "caBundle": ca}
        # The API server's longest wait: a busy two-core machine answers eight racing reviews.
        hooks.append({**hook, "failurePolicy": "Fail", "timeoutSeconds": 30, "clientConfig": client_config})
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": WEBHOOK_CONFIG},
        "webhooks": hooks,
    }


def _adapter(name: str, source: str = "file:///adapters/none") -> dict:
    """An adapter of a base service that does not exist: its rounds find nothing to load it into, and
    admission is what is under test."""
    return {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name},
        "spec": {"inferenceService": "no-base", "source": source},
    }


@pytest.fixture(scope="module")
def replicas(cluster: ClusterHandle, tmp_path_factory) -> Iterator[Replicas]:
    install_manifests(cluster)
    workdir = tmp_path_factory.mktemp("ha-lora")
    kubeconfig = service_account_kubeconfig(cluster, workdir / "operator.kubeconfig")
    ports, node_port = [free_port() for _ in range(REPLICAS)], free_port()
    operators = [
        OperatorProcess(
            kubeconfig,
            workdir / f"operator-{i}.log",
            # The chart owns the webhook configuration ('' here); distinct priorities: one active.
            (
                "--webhook-port",
                str(port),
                "--webhook-configuration",
                "",
                "--peering",
                PEERING,
                "--priority",
                str(REPLICAS - i),
            ),
        )  # fmt: skip
        for i, port in enumerate(ports)
    ]
    proxy: NodePortProxy | None = None
    client = KubeClient(cluster.kubeconfig)
    try:
        for operator in operators:
            operator.start()
        wait_for(lambda: all(_listens(p) for p in ports), 60, "every replica's webhook server to listen")
        proxy = _forwarder(ports, node_port)
        cluster.apply(manifest_yaml.dump(_webhook_configuration(cluster, node_port)))
        # The webhook is live once a bad source is refused in its words.
        wait_for(
            lambda: (
                "scheme 's3' is not supported"
                in cluster.kubectl(
                    "create", "-n", "default", "--dry-run=server", "-f", "-",
                    input=manifest_yaml.dump(_adapter("probe", "s3://bucket/x")), check=False,
                ).stderr
            ),
            60,
            "the admission webhook to answer through the forwarder",
        )  # fmt: skip
        yield Replicas(operators, client)
    finally:
        cluster.kubectl("delete", "validatingwebhookconfiguration", WEBHOOK_CONFIG, "--ignore-not-found",
                        check=False)  # fmt: skip
        for operator in operators:
            operator.stop()
        if proxy is not None:
            proxy.close()
        client.close()
        # Its TLS Secret too: a chart installed by a later module makes its own.
        cluster.kubectl("delete", "secret", WEBHOOK_TLS_SECRET, "-n", OPERATOR_NS, "--ignore-not-found",
                        check=False)  # fmt: skip
        cluster.kubectl("delete", "clusterkopfpeering", PEERING, "--ignore-not-found", check=False)
        print("\n".join(["", "maxLoRAAdapters under bursts (closing-note figures):", *REPORT]))


def _burst(client: KubeClient, ns: str, names: list[str]) -> dict[str, ApiError | None]:
    """Creates the adapters at once, one thread each (started together at a barrier): name -> the API's
    refusal, or None when it was created."""
    started = threading.Barrier(len(names))

    def create(name: str) -> ApiError | None:
        started.wait()
        try:
            client.create(ADAPTERS.format(ns=ns), _adapter(name))
        except ApiError as exc:
            return exc
        return None

    with ThreadPoolExecutor(len(names)) as pool:
        return dict(zip(names, pool.map(create, names), strict=True))


def _stored(cluster: ClusterHandle, ns: str) -> list[str]:
    return sorted(i["metadata"]["name"] for i in cluster.get_json("loraadapters", "-n", ns)["items"])


def _check_refusals(results: dict[str, ApiError | None], tenant: str, ns: str) -> None:
    for name, refusal in results.items():
        if refusal is None:
            continue
        assert refusal.status == 403, (name, str(refusal))
        message = str(refusal)
        assert f"tenant {tenant}: LoRAAdapter {ns}/{name} would be adapter number {LIMIT + 1}" in message, (
            message
        )
        assert f"maxLoRAAdapters is {LIMIT} and {LIMIT} are registered" in message, message


def _answered(operator: OperatorProcess) -> int:
    """The adapter creates this replica reviewed against the limit (each lists the stored adapters)."""
    _, text = operator.get("/metrics")
    pattern = r'^flotilla_operator_api_calls_total\{(?=[^}]*verb="list")(?=[^}]*resource="loraadapters")[^}]*\} (\S+)$'
    found = re.search(pattern, text, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


@pytest.fixture
def tenants(cluster: ClusterHandle) -> Iterator:
    """Makes a Tenant with maxLoRAAdapters LIMIT over a namespace of its own name; all are removed after
    (their adapters first, while the operator that holds their finalizers still runs)."""
    made: list[str] = []

    def make(label: str) -> str:
        name = f"ha-lora-{label}-{RUN}"
        cluster.kubectl("create", "namespace", name)
        body = {"apiVersion": "flotilla.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": name},
                "spec": {"namespaces": [name], "maxLoRAAdapters": LIMIT}}  # fmt: skip
        made.append(name)
        cluster.apply(manifest_yaml.dump(body))
        return name

    yield make
    for name in made:
        cluster.kubectl(
            "delete", "loraadapters", "--all", "-n", name, "--timeout=120s", check=False, timeout=150
        )
        cluster.kubectl("delete", "tenant", name, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _burst_stores_the_limit(replicas: Replicas, cluster: ClusterHandle, tenant: str, label: str) -> list[str]:
    """A burst of BURST creates in the tenant's namespace: exactly LIMIT stored (returned), every other
    create refused 403 naming the tenant, the count and the limit, and more than one replica answering."""
    ns = tenant
    before = [_answered(o) for o in replicas.operators]
    results = _burst(replicas.client, ns, [f"{label}{i}" for i in range(BURST)])
    reviewed = [_answered(o) - b for o, b in zip(replicas.operators, before, strict=True)]
    stored = _stored(cluster, ns)
    admitted = sorted(n for n, refusal in results.items() if refusal is None)
    REPORT.append(
        f"  replicas={REPLICAS} limit={LIMIT} ({tenant}): {BURST} creates at once, admitted {len(admitted)}, "
        f"refused {BURST - len(admitted)}, stored {len(stored)}; reviews (with retries) per replica {reviewed}"
    )
    assert stored == admitted and len(stored) == LIMIT, (stored, {n: str(e) for n, e in results.items()})
    _check_refusals(results, tenant, ns)
    assert sum(1 for n in reviewed if n) >= 2, f"the burst was answered by one replica only: {reviewed}"
    return stored


def test_bursts_of_adapter_creates_store_exactly_the_limit(
    replicas: Replicas, cluster: ClusterHandle, tenants
):
    """Three tenants, one burst each: each a fresh chance for the reviews to overlap. With the webhook
    counting stored adapters only (no reservation), 5 bursts in 6 stored 4 to 8 adapters here."""
    for round_ in range(ROUNDS):
        _burst_stores_the_limit(replicas, cluster, tenants(f"r{round_}"), "a")


def test_a_deleted_adapter_releases_its_reservation_and_frees_exactly_one_slot(
    replicas: Replicas, cluster: ClusterHandle, tenants
):
    tenant = ns = tenants("del")
    stored = _burst_stores_the_limit(replicas, cluster, tenant, "a")
    # The active replica takes the adapters in hand (its finalizer); a delete then releases the deleted
    # one's reservation before the object goes, and exactly one more create of a burst is admitted.
    wait_for(
        lambda: all(
            i["metadata"].get("finalizers") for i in cluster.get_json("loraadapters", "-n", ns)["items"]
        ),
        60,
        "the active replica's finalizer on every stored adapter",
    )
    victim = stored[0]
    cluster.kubectl("delete", "loraadapter", victim, "-n", ns, "--timeout=60s", timeout=90)
    ledger = cluster.get_json("configmap", reservations_name(tenant), "-n", OPERATOR_NS)
    assert adapter_data_key((ns, victim)) not in (ledger.get("data") or {}), ledger.get("data")
    second = _burst(replicas.client, ns, [f"b{i}" for i in range(4)])
    again = sorted(n for n, refusal in second.items() if refusal is None)
    REPORT.append(
        f"  after one delete: 4 creates at once, admitted {len(again)}, stored {len(_stored(cluster, ns))}"
    )
    assert len(again) == 1 and _stored(cluster, ns) == sorted([*stored[1:], *again]), second
    _check_refusals(second, tenant, ns)
