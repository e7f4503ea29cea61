"""Chaos under load on the real local cluster: things are killed while the gateway carries requests, and
afterwards an invariant is checked and the fleet must converge.

One fleet for the module: the operator (host process, metering every 2 s) and the gateway (host processes:
the picker, and the real Envoy that every request crosses) under their own ServiceAccounts, one Tenant with an API key, and a service of two engine replicas on a
real tiny model. The cases, each with its invariant:
- an engine process SIGKILLed under 30 streams, and an engine pod deleted gracefully under 30 streams:
  no request fails before its first token (Envoy retries those on the pick's fallback replica), a stream
  cut after its first token never looks complete (Envoy resets the client's connection: no [DONE]), and the service is back to two Ready
  replicas with no pod left Terminating;
- kube-apiserver restarted, then etcd restarted, under a steady request load: no request fails (the
  gateway routes from what its watches last saw), and the gateway's watches resume (an API key created
  after the restarts works);
- the node agent restarted under load, a pod deleted while it is down: the running engines are adopted
  (same process, restart count and start time; no request fails), the deleted one is stopped and its
  end recorded;
- the operator SIGKILLed right after a scale-up was written: the next operator carries it out.
Every case also checks metering over its window: the GPU-seconds the operator adds between a round
before and a round after equal the pods' spans as a watch of the test's own saw them (within a second
per pod). Each case prints what it measured, for the closing notes; the whole module takes a few minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flotilla import manifest_yaml
from flotilla.cluster.control_plane import up
from flotilla.cluster.handle import ClusterHandle, free_port, wait_for
from flotilla.cluster.kubeclient import KubeClient
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
from flotilla.operator.controllers.failpoints import ENV as FAILPOINT_ENV
from flotilla.operator.controllers.webhook_tls import SECRET_NAME as WEBHOOK_TLS_SECRET
from flotilla.operator.naming import METERING_FINALIZER
from flotilla.operator.tenancy.metering import pod_gpus
from flotilla.operator.tenancy.settings import WebhookSettings
from flotilla.timestamps import parse_time

pytestmark = pytest.mark.cluster

RUN = uuid.uuid4().hex[:6]
KEY = f"fl-chaos-{uuid.uuid4().hex}"
STREAMS = 30
REPORT: list[str] = []


class PodWitness:
    """Every pod of the fleet's namespace as a watch last saw it, pods since deleted included: the test's
    own record of each pod's span, to check the operator's metering against."""

    def __init__(self, cluster: ClusterHandle, namespace: str):
        self.client = KubeClient(cluster.kubeconfig)
        self.path = f"/api/v1/namespaces/{namespace}/pods"
        self.last: dict[str, dict] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:  # the API server itself is restarted by one case: list again and go on
                listing = self.client.get(self.path)
                for pod in listing["items"]:
                    self.last[pod["metadata"]["uid"]] = pod
                for event in self.client.watch(self.path, listing["metadata"]["resourceVersion"], 60):
                    if self.stop.is_set() or event["type"] == "ERROR":
                        break
                    if event["type"] != "BOOKMARK":
                        self.last[event["object"]["metadata"]["uid"]] = event["object"]
            except Exception:
                self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()
        self.client.close()


def _time(stamp: str) -> float:
    return parse_time(stamp).timestamp()


def _finished(pod: dict) -> float | None:
    """The latest end the node recorded among the pod's containers (None: none has ended)."""
    ends = [
        _time(t)
        for s in (pod.get("status") or {}).get("containerStatuses") or []
        if (t := ((s.get("state") or {}).get("terminated") or {}).get("finishedAt"))
    ]
    return max(ends) if ends else None


def _span(pod: dict, since: float, until: float) -> float:
    """GPU-seconds the pod held between two metering rounds: from its binding to its last container's
    end (a deleted pod's, as its node recorded it), clipped to the window."""
    bound = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")["lastTransitionTime"]
    deleted = pod["metadata"].get("deletionTimestamp")
    end = (_finished(pod) or _time(deleted)) if deleted else until
    return pod_gpus(pod) * max(0.0, min(end, until) - max(_time(bound), since))


def _round_after(fleet: Fleet, stamp: str | None) -> dict:
    """The Tenant's status once a metering round later than `stamp` has written it."""

    def fresh() -> dict | None:
        status = fleet.cluster.get_json("tenant", fleet.tenant).get("status") or {}
        last = status.get("lastMeteredTime")
        return status if last and last != stamp else None

    status = wait_for(fresh, 60, "a metering round")
    assert status is not None
    return status


@contextlib.contextmanager
def _metering_checked(fleet: Fleet, label: str) -> Iterator[None]:
    """Metering across the body: the GPU-seconds the operator adds between a round before and a round
    after (once every pod deleted meanwhile is gone from the API) equal the pods' spans, within the
    one-second resolution of the timestamps per pod."""
    assert fleet.witness is not None
    service = f"{fleet.ns}/chat"
    start = _round_after(fleet, None)
    start = _round_after(fleet, start["lastMeteredTime"])
    yield
    wait_for(
        lambda: (
            not [
                p
                for p in fleet.cluster.get_json("pods", "-n", fleet.ns)["items"]
                if p["metadata"].get("deletionTimestamp")
            ]
        ),
        120,
        "every deleted pod metered and let go",
    )
    end = _round_after(fleet, _round_after(fleet, None)["lastMeteredTime"])
    since, until = _time(start["lastMeteredTime"]), _time(end["lastMeteredTime"])
    # Pods the witness saw (ended ones keep their last state) that overlap the window.
    spans = {
        pod["metadata"]["name"]: _span(pod, since, until)
        for pod in list(fleet.witness.last.values())
        if pod["metadata"]["labels"].get("flotilla.dev/inferenceservice") == "chat"
        and any(
            c["type"] == "PodScheduled" and c["status"] == "True"
            for c in (pod.get("status") or {}).get("conditions") or []
        )
    }
    spans = {name: span for name, span in spans.items() if span > 0}
    metered = end["usage"]["total"]["byService"][service] - start["usage"]["total"]["byService"][service]
    error = metered - sum(spans.values())
    REPORT.append(
        f"  {label}: metered {metered:.2f} GPU-s over {until - since:.1f}s for {len(spans)} pods, "
        f"minus their spans: {error:+.2f}"
    )
    assert abs(error) <= 1.0 * len(spans), (metered, spans)


@dataclass
class Fleet:
    cluster: ClusterHandle
    workdir: Path
    tenant: str = f"chaos-{RUN}"
    ns: str = f"chaos-{RUN}"
    operator: OperatorProcess | None = None
    gateway: GatewayProcess | None = None
    gateway_kubeconfig: Path | None = None
    witness: PodWitness | None = None

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
    # With its admission webhook (failurePolicy Fail: down with the operator), as a platform runs it.
    f.operator = OperatorProcess(
        service_account_kubeconfig(cluster, workdir / "operator.kubeconfig"),
        workdir / "operator.log",
        ("--engine-token-file", str(master), "--metering-interval", "2", "--webhook-port", str(free_port())),
        host_path_roots=(workdir,),
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
    f.witness = PodWitness(cluster, f.ns)
    f.gateway = GatewayProcess(f.gateway_kubeconfig, workdir / "gateway.log", OPERATOR_NS, master)
    try:
        cluster.apply_once_admitted(
            manifest_yaml.dump_all(docs), 60, "the fleet's objects admitted by the operator's webhook"
        )
        f.gateway.start()
        wait_for(lambda: f.converged(2), 300, "two ready replicas of chat")
        yield f
    finally:
        print("\n".join(["", "chaos cases (closing-note figures):", *REPORT]))
        f.witness.close()
        f.gateway.stop()
        cluster.kubectl("delete", "fisvc", "--all", "-n", f.ns, "--timeout=60s", check=False)
        f.operator.stop()
        # The webhook and its TLS Secret go with this host-process operator (a chart installed later makes
        # its own).
        cluster.kubectl("delete", "validatingwebhookconfiguration", WebhookSettings().configuration,
                        "--ignore-not-found", check=False)  # fmt: skip
        cluster.kubectl(
            "delete", "secret", WEBHOOK_TLS_SECRET, "-n", OPERATOR_NS, "--ignore-not-found", check=False
        )
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
        f"(each ended incomplete, by {sorted({(r.failure or str(r.error))[:60] for r in results if r.failed_after_first_token})}), "
        f"converged {time.monotonic() - t0:.1f}s after the last stream"
    )
    return results


def _gateway_retries(fleet: Fleet) -> float:
    assert fleet.gateway is not None
    text = httpx.get(fleet.gateway.metrics_url, timeout=10, trust_env=False).text
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
    # A stream cut after its first token is never a silent cut: Envoy cannot write an event after the
    # upstream is gone, so it resets the client's connection, which the client sees as an incomplete
    # response (the relay, in development mode, ends it with an error event and [DONE] instead).
    assert all(not r.done and (r.failure or (r.error or {}).get("code")) for r in cut), [
        (r.failure, r.error) for r in cut
    ]


def test_an_engine_sigkilled_under_30_streams_fails_no_request_before_its_first_token(fleet: Fleet):
    victim = fleet.ready_pods()[0]
    with _metering_checked(fleet, "engine SIGKILLed"):
        results = _under_streams(
            fleet, lambda: os.kill(_engine_pid(fleet, victim), signal.SIGKILL), "engine SIGKILLed"
        )
    _assert_streams(results)


def test_an_engine_pod_deleted_gracefully_under_30_streams_fails_no_request(fleet: Fleet):
    victim = fleet.ready_pods()[0]["metadata"]["name"]
    with _metering_checked(fleet, "pod deleted"):
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
    with _metering_checked(fleet, "API server and etcd restarted"):
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
                manifest_yaml.dump(
                    key_secret(fleet.tenant, "second", second, OPERATOR_NS, f"{fleet.tenant}-keys2")
                )
            )
            assert fleet.gateway is not None
            url = fleet.gateway.url + "/v1/completions"
            body = {"model": "tiny", "prompt": "new key", "max_tokens": 2}
            t0 = time.monotonic()
            wait_for(
                lambda: (
                    httpx.post(
                        url,
                        json=body,
                        timeout=60,
                        trust_env=False,
                        headers={"Authorization": f"Bearer {second}"},
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


def test_the_node_agent_restarted_under_gateway_load_adopts_its_pods(fleet: Fleet):
    """The agent is stopped (the kubelet's own restart); while it is down one engine pod is deleted. The
    next agent adopts the running engines (same process, restart count and start time: nothing restarts,
    no request fails), stops the deleted pod's engine within its grace period and records its end, which
    the operator meters exactly."""
    cluster = fleet.cluster
    table = ProcessTable(cluster.config.state_dir / "pids")
    survivor, victim = fleet.ready_pods()
    before = survivor["status"]["containerStatuses"][0]
    survivor_pid = _engine_pid(fleet, survivor)
    load = Load(fleet)
    worker = threading.Thread(target=load.run)
    with _metering_checked(fleet, "node agent restarted, a pod deleted meanwhile"):
        worker.start()
        try:
            wait_for(lambda: load.sent >= 5, 60, "requests flowing")
            t0 = time.monotonic()
            assert table.stop("node-agent", grace_seconds=20)
            cluster.kubectl("delete", "pod", victim["metadata"]["name"], "-n", fleet.ns, "--wait=false")
            sent = load.sent
            wait_for(lambda: load.sent >= sent + 3, 60, "requests served while the node agent is down")
            back = time.time()
            up(cluster.config, log=lambda _: None)
            wait_for(lambda: fleet.converged(2), 240, "two Ready replicas under the new agent")
            converged = time.monotonic() - t0
        finally:
            load.stop.set()
            worker.join(120)
    after = next(
        s
        for s in cluster.get_json("pod", survivor["metadata"]["name"], "-n", fleet.ns)["status"][
            "containerStatuses"
        ]
        if s["name"] == "engine"
    )
    assert _engine_pid(fleet, survivor) == survivor_pid
    assert after["restartCount"] == before["restartCount"]
    assert after["state"]["running"]["startedAt"] == before["state"]["running"]["startedAt"]
    assert after.get("containerID") == before.get("containerID")
    # The deleted pod's engine ran until the new agent stopped it; its recorded end says so.
    assert fleet.witness is not None
    ended = fleet.witness.last[victim["metadata"]["uid"]]
    finished = _finished(ended)
    agent_log = (cluster.config.logs_dir / "node-agent.log").read_text().splitlines()
    told = [line for line in agent_log if victim["metadata"]["name"] in line]
    assert finished is not None and finished >= back - 1, (ended["status"].get("containerStatuses"), told)
    REPORT.append(
        f"  node agent restarted: {load.sent} requests, failed {len(load.failures)}; survivor kept pid "
        f"{survivor_pid} and restart count {after['restartCount']}; converged {converged:.1f}s after the stop"
    )
    assert load.failures == [], load.failures[:3]


def test_the_operator_killed_after_a_scale_up_carries_it_out_when_back(fleet: Fleet):
    assert fleet.operator is not None
    with _metering_checked(fleet, "operator SIGKILLed, a pod scaled away meanwhile"):
        fleet.operator.stop(signal.SIGKILL)
        try:
            # Without an operator the webhook is down too (failurePolicy Fail): the admin scales the
            # Deployment away from the spec, which the next operator must correct.
            fleet.cluster.kubectl("scale", "deployment", "chat", "-n", fleet.ns, "--replicas=1")
        finally:
            fleet.operator.start()
        t0 = time.monotonic()
        wait_for(
            lambda: fleet.converged(2), 240, "the restarted operator to bring chat back to its two replicas"
        )
    REPORT.append(
        f"  operator SIGKILLed, Deployment scaled away meanwhile: converged in {time.monotonic() - t0:.1f}s"
    )


# -- the operator killed at a chosen step (failpoints) ---------------------------------------------------


def _killed_at(
    fleet: Fleet, point: str, trigger: Callable[[], object] = lambda: None, wait: bool = True
) -> str:
    """Replaces the operator with one armed with the failpoint `point`, runs `trigger`, and waits for it to
    die there (SIGKILL); then starts a plain operator again, whatever happened. `wait`: whether the armed
    operator must answer /healthz first (it serves the webhook a trigger may need). Returns the
    failpoint's log line."""
    op = fleet.operator
    assert op is not None
    before = op.log_path.read_text().count(f"failpoint {point} reached")
    op.stop()
    op.start(env={FAILPOINT_ENV: point}, wait=wait)
    try:
        if wait:
            _webhook_answers(fleet)
        triggered = trigger()
        wait_for(
            lambda: op.proc is not None and op.proc.poll() is not None,
            120,
            f"the operator to die at {point} (the trigger gave {triggered!r})",
        )
        assert op.proc is not None and op.proc.returncode == -signal.SIGKILL, op.proc.returncode
        lines = [
            line for line in op.log_path.read_text().splitlines() if f"failpoint {point} reached" in line
        ]
        assert len(lines) == before + 1, f"the operator died elsewhere than at {point}"
    finally:
        op.stop()
        op.start()
        _webhook_answers(fleet)
    return lines[-1]


def _webhook_answers(fleet: Fleet) -> None:
    """Waits until the operator's webhook reviews again: a server-side dry run of a change to chat."""
    patch = json.dumps({"metadata": {"labels": {"chaos-probe": "1"}}})
    wait_for(
        lambda: fleet.cluster.kubectl(
            "patch", "fisvc", "chat", "-n", fleet.ns, "--type=merge", "-p", patch, "--dry-run=server", check=False
        ).returncode == 0,
        60,
        "the operator's webhook to answer",
    )  # fmt: skip


def test_the_operator_killed_in_a_metering_round_meters_exactly_and_releases_the_pod(fleet: Fleet):
    """Killed after a round counted a pod's end but before it wrote (the round is lost: the next one
    counts it), and after it wrote but before it released the pod's finalizer (the next one must not
    count the span again)."""
    for point in ("metering.counted", "metering.written"):
        with _metering_checked(fleet, f"operator killed at {point}, a pod ended meanwhile"):
            victim = fleet.ready_pods()[0]["metadata"]
            assert fleet.operator is not None
            fleet.operator.stop()
            fleet.cluster.kubectl("delete", "pod", victim["name"], "-n", fleet.ns, "--wait=false")
            # Its end is recorded by the node while no operator runs; the armed one meters it and dies.
            wait_for(
                lambda uid=victim["uid"]: any(
                    p["metadata"]["uid"] == uid and p["metadata"].get("deletionGracePeriodSeconds") == 0
                    for p in fleet.cluster.get_json("pods", "-n", fleet.ns)["items"]
                ),
                60,
                "the node to stop the pod (its metering finalizer keeps it)",
            )
            _killed_at(fleet, point, wait=False)
            t0 = time.monotonic()
            wait_for(lambda: fleet.converged(2), 240, "two Ready replicas, the ended pod released")
        REPORT.append(
            f"  operator killed at {point}: converged {time.monotonic() - t0:.1f}s after the restart"
        )


def test_the_operator_killed_between_a_spec_change_and_its_status_carries_it_out(fleet: Fleet):
    def scale_to_3() -> None:
        fleet.cluster.kubectl("scale", "fisvc", "chat", "-n", fleet.ns, "--replicas=3")

    with _metering_checked(fleet, "operator killed at reconcile.applied"):
        _killed_at(fleet, "reconcile.applied", scale_to_3)
        t0 = time.monotonic()
        wait_for(lambda: fleet.converged(3), 240, "three Ready replicas after the restart")
        service = fleet.cluster.get_json("fisvc", "chat", "-n", fleet.ns)
        assert service["status"]["observedGeneration"] == service["metadata"]["generation"]
        REPORT.append(f"  operator killed at reconcile.applied: converged {time.monotonic() - t0:.1f}s after")
        fleet.cluster.kubectl("scale", "fisvc", "chat", "-n", fleet.ns, "--replicas=2")
        wait_for(lambda: fleet.converged(2), 240, "back to two replicas")


def _reservations(fleet: Fleet) -> dict:
    config_map = fleet.cluster.get_json("configmap", f"flotilla-quota-{fleet.tenant}", "-n", OPERATOR_NS)
    return {key: json.loads(value) for key, value in (config_map.get("data") or {}).items()}


def test_the_operator_killed_after_reserving_quota_refuses_the_request_and_the_reservation_lapses(
    fleet: Fleet, tmp_path: Path
):
    """The review wrote its reservation and died before answering: the API server refuses the create
    (the webhook fails closed), the quota is never exceeded, and the orphaned reservation stops counting
    within its time to live, so a request that fits is admitted again."""
    # Its pods never load anything: the quota is what is under test. Under the operator's host-path root,
    # so that the webhook gets as far as the quota.
    absent = fleet.workdir / f"absent-model-{tmp_path.name}"

    def create(name: str, replicas: int) -> subprocess.CompletedProcess:
        body = inference_service(name, absent, fleet.ns, replicas=replicas)
        return fleet.cluster.kubectl("apply", "-f", "-", input=manifest_yaml.dump(body), check=False)

    outcome: list[subprocess.CompletedProcess] = []
    _killed_at(fleet, "admission.reserved", lambda: outcome.append(create("lost", 1)) or outcome[0])
    assert outcome[0].returncode != 0, outcome[0].stdout
    assert fleet.cluster.kubectl("get", "fisvc", "lost", "-n", fleet.ns, check=False).returncode != 0
    held = json.dumps(_reservations(fleet))
    assert "lost" in held, held
    # chat holds 2 of 4 GPUs (a reservation from an earlier raise may still hold 3) and the orphan 1
    # more: a service of 2 is refused until they lapse.
    t0 = time.monotonic()
    refusals: list[str] = []

    def admitted() -> bool:
        done = create("found", 2)
        if done.returncode != 0:
            refusals.append(done.stderr)
        return done.returncode == 0

    try:
        wait_for(admitted, 120, "a fitting service admitted once the orphaned reservation lapsed", interval=2)
        # Refused while the orphan counted, for the quota (not a guess): it did count until it lapsed.
        assert any("quota" in r for r in refusals), refusals[:2]
        REPORT.append(
            f"  operator killed at admission.reserved: the create refused, a fitting one admitted "
            f"{time.monotonic() - t0:.1f}s later after {len(refusals)} quota refusals"
        )
    finally:
        fleet.cluster.kubectl("delete", "fisvc", "found", "-n", fleet.ns, "--wait=false", check=False)
    wait_for(lambda: fleet.converged(2), 240, "the fleet back to chat's two replicas")


def test_the_operator_killed_after_an_autoscaler_scaled_settles_where_the_rule_says(fleet: Fleet):
    autoscaling = {"minReplicas": 1, "maxReplicas": 2, "queueDepthTarget": 100, "periodSeconds": 1,
                   "scaleDownWindowSeconds": 0}  # fmt: skip

    def autoscale() -> None:
        patch = json.dumps({"spec": {"autoscaling": autoscaling}})
        fleet.cluster.kubectl("patch", "fisvc", "chat", "-n", fleet.ns, "--type=merge", "-p", patch)

    try:
        with _metering_checked(fleet, "operator killed at autoscaling.scaled"):
            # Idle: the rule scales chat down to its minimum; the armed operator dies after the scale.
            _killed_at(fleet, "autoscaling.scaled", autoscale)
            t0 = time.monotonic()
            wait_for(lambda: fleet.converged(1), 240, "chat at its minimum of one replica")
            status = wait_for(
                lambda: (
                    s if (s := fleet.cluster.get_json("fisvc", "chat", "-n", fleet.ns)["status"].get("autoscaling"))
                    and s.get("desiredReplicas") == 1 else None
                ),
                60,
                "the next operator's autoscaler to record its decision",
            )  # fmt: skip
            assert status["conditions"], status
            REPORT.append(
                f"  operator killed at autoscaling.scaled: settled {time.monotonic() - t0:.1f}s after"
            )
    finally:
        patch = json.dumps({"spec": {"autoscaling": None, "replicas": 2}})
        fleet.cluster.kubectl("patch", "fisvc", "chat", "-n", fleet.ns, "--type=merge", "-p", patch)
    wait_for(lambda: fleet.converged(2), 240, "chat back at two replicas")
