"""Chaos under load on the real local cluster: things are killed while the gateway carries requests, and
afterwards an invariant is checked and the fleet must converge.

One fleet for the module: the operator (host process, metering every 2 s) and the gateway (host process)
under their own ServiceAccounts, one Tenant with an API key, and a service of two engine replicas on a
real tiny model. The cases, each with its invariant:
- an engine process SIGKILLed under 30 streams, and an engine pod deleted gracefully under 30 streams:
  no request fails before its first token (the gateway retries those on the other replica), a stream cut
  after its first token ends with an error event and [DONE], and the service is back to two Ready
  replicas with no pod left Terminating;
- kube-apiserver restarted, then etcd restarted, under a steady request load: no request fails (the
  gateway routes from what its watches last saw), and the gateway's watches resume (an API key created
  after the restarts works);
- the operator SIGKILLed right after a scale-up was written: the next operator carries it out.
Each case prints what it measured, for the closing notes; the whole module takes a few minutes.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from flotilla.cluster.control_plane import up
from flotilla.cluster.handle import ClusterHandle, wait_for
from flotilla.cluster.processes import ProcessTable
from flotilla.contract import GATEWAY_RETRIES, counter_total
from flotilla.gateway.cmd import key_secret
from flotilla.gateway.local import GatewayProcess, service_account_token
from flotilla.operator.cmd.local import (
    OPERATOR_NS,
    OperatorProcess,
    inference_service,
    install_manifests,
    kubeconfig_for,
    service_account_kubeconfig,
    tiny_model,
)
from flotilla.operator.naming import METERING_FINALIZER

pytestmark = pytest.mark.cluster

RUN = uuid.uuid4().hex[:6]
KEY = f"fl-chaos-{uuid.uuid4().hex}"
STREAMS = 30
REPORT: list[str] = []


@dataclass
class Fleet:
    cluster: ClusterHandle
    workdir: Path
    tenant: str = f"chaos-{RUN}"
    ns: str = f"chaos-{RUN}"
    operator: OperatorProcess | None = None
    gateway: GatewayProcess | None = None
    gateway_kubeconfig: Path | None = None

    def ready_pods(self) -> list[dict]:
        pods = self.cluster.get_json("pods", "-n", self.ns, "-l", "flotilla.dev/inferenceservice=chat")[
            "items"
        ]
        return [
            p for p in pods
            if not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        ]  # fmt: skip

    def converged(self, replicas: int) -> bool:
        """`replicas` Ready engine pods, none left Terminating, and the service's status agrees."""
        pods = self.cluster.get_json("pods", "-n", self.ns, "-l", "flotilla.dev/inferenceservice=chat")[
            "items"
        ]
        status = self.cluster.get_json("fisvc", "chat", "-n", self.ns).get("status") or {}
        return (
            len(self.ready_pods()) == replicas
            and len(pods) == replicas
            and len(status.get("endpoints") or []) == replicas
        )


@pytest.fixture(scope="module")
def fleet(cluster: ClusterHandle, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("chaos")
    model = tiny_model(workdir / "tiny-llama")
    f = Fleet(cluster, workdir)
    install_manifests(cluster)
    master = workdir / "engine-token"
    master.write_text(uuid.uuid4().hex)
    f.operator = OperatorProcess(
        service_account_kubeconfig(cluster, workdir / "operator.kubeconfig"),
        workdir / "operator.log",
        ("--engine-token-file", str(master), "--metering-interval", "2"),
    )
    token = service_account_token(cluster, OPERATOR_NS)
    f.gateway_kubeconfig = kubeconfig_for(cluster, workdir / "gateway.kubeconfig", {"token": token})
    cluster.kubectl("create", "namespace", f.ns)
    tenant = {"apiVersion": "flotilla.dev/v1alpha1", "kind": "Tenant", "metadata": {"name": f.tenant},
              "spec": {"namespaces": [f.ns], "gpuQuota": {"h100": 4}}}  # fmt: skip
    docs = [
        tenant,
        key_secret(f.tenant, "first", KEY, OPERATOR_NS, f"{f.tenant}-keys"),
        inference_service("chat", model, f.ns, replicas=2, engine={"maxNumSeqs": 16}),
    ]
    f.operator.start()
    f.gateway = GatewayProcess(f.gateway_kubeconfig, workdir / "gateway.log", OPERATOR_NS, master)
    try:
        cluster.apply(yaml.safe_dump_all(docs))
        f.gateway.start()
        wait_for(lambda: f.converged(2), 300, "two ready replicas of chat")
        yield f
    finally:
        print("\n".join(["", "chaos cases (closing-note figures):", *REPORT]))
        f.gateway.stop()
        cluster.kubectl("delete", "fisvc", "--all", "-n", f.ns, "--timeout=60s", check=False)
        f.operator.stop()
        cluster.kubectl("delete", "namespace", f.ns, "--wait=false", check=False)
        cluster.kubectl("delete", "tenant", f.tenant, "--wait=false", check=False)
        cluster.kubectl(
            "delete", "secret", "-n", OPERATOR_NS, f"{f.tenant}-keys", "--ignore-not-found", check=False
        )


@dataclass
class Stream:
    status: int = 0
    tokens: int = 0
    done: bool = False
    error: dict | None = None
    failure: str = ""  # a transport failure or a non-200: what the client saw

    @property
    def failed_before_first_token(self) -> bool:
        return self.tokens == 0 and not self.done

    @property
    def failed_after_first_token(self) -> bool:
        return self.tokens > 0 and (self.error is not None or not self.done)


def _stream(fleet: Fleet, i: int, out: Stream, started: threading.Semaphore) -> None:
    assert fleet.gateway is not None
    body = {
        "model": "tiny",
        "prompt": f"chaos stream {i} " * 4,
        "max_tokens": 256,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with httpx.stream("POST", fleet.gateway.url + "/v1/completions", json=body, timeout=180, trust_env=False,
                          headers={"Authorization": f"Bearer {KEY}"}) as rsp:  # fmt: skip
            out.status = rsp.status_code
            if rsp.status_code != 200:
                out.failure = rsp.read().decode(errors="replace")[:200]
                return
            for line in rsp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out.done = out.error is None
                    return
                event = json.loads(data)
                if "error" in event:
                    out.error = event["error"]
                elif event["choices"][0].get("text"):
                    out.tokens += 1
                    if out.tokens == 1:
                        started.release()
    except httpx.HTTPError as exc:
        out.failure = f"{type(exc).__name__}: {exc}"


def _under_streams(fleet: Fleet, fault: Callable[[], None], label: str) -> list[Stream]:
    """30 streams at once; `fault` runs once a third of them are producing tokens (so that both replicas
    have streams in flight, some past their first token and some before it)."""
    results = [Stream() for _ in range(STREAMS)]
    started = threading.Semaphore(0)
    threads = [threading.Thread(target=_stream, args=(fleet, i, results[i], started)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for _ in range(STREAMS // 3):
        assert started.acquire(timeout=120), "streams produced no tokens"
    retries = _gateway_retries(fleet)
    fault()
    for t in threads:
        t.join(240)
    before = sum(r.failed_before_first_token for r in results)
    after = sum(r.failed_after_first_token for r in results)
    t0 = time.monotonic()
    wait_for(lambda: fleet.converged(2), 240, "two Ready replicas again, none Terminating")
    REPORT.append(
        f"  {label}: {STREAMS} streams, retried before their first token {_gateway_retries(fleet) - retries:.0f}, "
        f"failed before first token {before}, failed after {after} "
        f"(each ended with an error event and [DONE]: {all(r.error is not None for r in results if r.failed_after_first_token)}), "
        f"converged {time.monotonic() - t0:.1f}s after the last stream"
    )
    return results


def _gateway_retries(fleet: Fleet) -> float:
    assert fleet.gateway is not None
    text = httpx.get(fleet.gateway.url + "/metrics", timeout=10, trust_env=False).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == counter_total(GATEWAY_RETRIES)
    )


def _engine_pid(fleet: Fleet, pod: dict) -> int:
    meta = pod["metadata"]
    table = ProcessTable(fleet.cluster.config.state_dir / "pods" / "pids")
    record = table.running(f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}_engine")
    assert record is not None, f"no running engine process recorded for {meta['name']}"
    return record.pid


def _assert_streams(results: list[Stream]) -> None:
    assert all(r.status == 200 for r in results), [r.failure for r in results if r.status != 200]
    assert not [r for r in results if r.failed_before_first_token], [
        (r.failure, r.error) for r in results if r.failed_before_first_token
    ]
    cut = [r for r in results if r.failed_after_first_token]
    # A stream cut after its first token is never a silent cut: it ends with an error event and [DONE].
    assert all(r.error is not None and r.error.get("code") for r in cut), [(r.failure, r.error) for r in cut]


def test_an_engine_sigkilled_under_30_streams_fails_no_request_before_its_first_token(fleet: Fleet):
    victim = fleet.ready_pods()[0]
    results = _under_streams(
        fleet, lambda: os.kill(_engine_pid(fleet, victim), signal.SIGKILL), "engine SIGKILLed"
    )
    _assert_streams(results)


def test_an_engine_pod_deleted_gracefully_under_30_streams_fails_no_request(fleet: Fleet):
    victim = fleet.ready_pods()[0]["metadata"]["name"]
    results = _under_streams(
        fleet,
        lambda: fleet.cluster.kubectl("delete", "pod", victim, "-n", fleet.ns, "--wait=false"),
        "pod deleted",
    )
    _assert_streams(results)
    # A graceful delete drains: the replica finishes what it has, so nothing is cut at all.
    assert not [r for r in results if r.failed_after_first_token], [r.error for r in results]
    # Its metering finalizer went once the operator had metered its end.
    leftover = [
        p["metadata"]["name"]
        for p in fleet.cluster.get_json("pods", "-n", fleet.ns)["items"]
        if METERING_FINALIZER in (p["metadata"].get("finalizers") or [])
        and p["metadata"].get("deletionTimestamp")
    ]
    assert leftover == []


@dataclass
class Load:
    """Non-streaming requests one after another until stopped."""

    fleet: Fleet
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        assert self.fleet.gateway is not None
        while not self.stop.is_set():
            body = {"model": "tiny", "prompt": f"load {self.sent}", "max_tokens": 4, "ignore_eos": True}
            try:
                rsp = httpx.post(self.fleet.gateway.url + "/v1/completions", json=body, timeout=60, trust_env=False,
                                 headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
                if rsp.status_code != 200:
                    self.failures.append(f"{rsp.status_code}: {rsp.text[:200]}")
            except httpx.HTTPError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
            self.sent += 1


def _api_answers(cluster: ClusterHandle) -> bool:
    return cluster.kubectl("get", "--raw", "/readyz", check=False, timeout=10).returncode == 0


def test_the_api_server_and_etcd_restart_under_gateway_load(fleet: Fleet):
    cluster = fleet.cluster
    table = ProcessTable(cluster.config.state_dir / "pids")
    load = Load(fleet)
    worker = threading.Thread(target=load.run)
    worker.start()
    try:
        wait_for(lambda: load.sent >= 5, 60, "requests flowing")
        for component in ("kube-apiserver", "etcd"):
            t0 = time.monotonic()
            table.stop(component, grace_seconds=10)
            wait_for(lambda: not _api_answers(cluster), 30, f"the API gone with {component}")
            sent = load.sent
            wait_for(
                lambda sent=sent: load.sent >= sent + 3, 60, f"requests served while {component} is down"
            )
            up(cluster.config, log=lambda _: None)
            wait_for(lambda: _api_answers(cluster), 120, f"the API back after {component}")
            REPORT.append(f"  {component} restarted: API back in {time.monotonic() - t0:.1f}s")
        # The gateway's watches resumed: a key made after the restarts works once its watch delivers it.
        second = f"fl-chaos-2-{uuid.uuid4().hex}"
        cluster.apply(
            yaml.safe_dump(key_secret(fleet.tenant, "second", second, OPERATOR_NS, f"{fleet.tenant}-keys2"))
        )
        assert fleet.gateway is not None
        url = fleet.gateway.url + "/v1/completions"
        body = {"model": "tiny", "prompt": "new key", "max_tokens": 2}
        t0 = time.monotonic()
        wait_for(
            lambda: (
                httpx.post(
                    url, json=body, timeout=60, trust_env=False, headers={"Authorization": f"Bearer {second}"}
                ).status_code
                == 200
            ),  # fmt: skip
            120,
            "the gateway to learn a key created after the restarts",
        )
        REPORT.append(
            f"  watches resumed: a new key worked {time.monotonic() - t0:.1f}s after it was created"
        )
    finally:
        load.stop.set()
        worker.join(120)
    REPORT.append(f"  API server and etcd restarts: {load.sent} requests, failed {len(load.failures)}")
    assert load.failures == [], load.failures[:3]
    wait_for(lambda: fleet.converged(2), 120, "the fleet converged after the restarts")


def test_the_operator_killed_after_a_scale_up_carries_it_out_when_back(fleet: Fleet):
    assert fleet.operator is not None
    fleet.operator.stop(signal.SIGKILL)
    try:
        # Without an operator the webhook is down too (failurePolicy Fail): the admin scales the Deployment
        # away from the spec, which the next operator must correct.
        fleet.cluster.kubectl("scale", "deployment", "chat", "-n", fleet.ns, "--replicas=1")
    finally:
        fleet.operator.start()
    t0 = time.monotonic()
    wait_for(lambda: fleet.converged(2), 240, "the restarted operator to bring chat back to its two replicas")
    REPORT.append(
        f"  operator SIGKILLed, Deployment scaled away meanwhile: converged in {time.monotonic() - t0:.1f}s"
    )
