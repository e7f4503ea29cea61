"""The gateway over HTTP, in front of real engines (uvicorn in threads of this process, as the other server
tests): routing across replicas, streaming, retries, client disconnects, tenant keys, rate limits, held
requests and bad input, with real clients (httpx, openai).

The fleet here is a hand-set one (no Kubernetes): what the watches would build is set directly, and
`changed()` plays a watch event. e2e/test_gateway.py covers the same gateway against the local cluster.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from flotilla.contract import (
    API_KEY_SECRET_LABEL,
    GATEWAY_HELD_REQUESTS,
    GATEWAY_PREDICTED_HIT_TOKENS,
    GATEWAY_RATE_LIMITED,
    GATEWAY_REQUESTS,
    GATEWAY_RETRIES,
    GATEWAY_ROUTING_DECISIONS,
    GATEWAY_STREAM_ERRORS,
    PREFIX_CACHE_HITS,
    REQUEST_SUCCESS,
    TENANT_PROMPT_TOKENS,
    api_key_digest,
    counter_total,
    engine_token,
    gateway_token,
    token_digest,
)
from flotilla.gateway.app import Gateway, build_app
from flotilla.gateway.config import GatewaySettings
from flotilla.gateway.core.keys import KeyRing
from flotilla.gateway.core.rate_limit import RateLimits
from flotilla.gateway.core.services import Endpoint, ModelIndex, ServiceView
from flotilla.gateway.fleet import Fleet

from ..engine.server.conftest import MODEL_NAME

MASTER = "master-token-for-tests"
# What the operator gives an engine pod of namespace ns-team-a (desired/workload.py).
ENGINE_TRUST = {
    "internal_token": engine_token(MASTER, "ns-team-a"),
    "gateway_token_sha256": token_digest(gateway_token(MASTER)),
}
KEY_A, KEY_B = "fl-key-of-team-a", "fl-key-of-team-b"
SYSTEM = "You are a terse assistant who answers in one word. " * 4


class HandSetFleet(Fleet):
    """The fleet a watch would build, set by the test."""

    def __init__(self, services: list[ServiceView], limits: dict[str, RateLimits] | None = None) -> None:
        super().__init__()
        self.keys = KeyRing.from_secrets([
            {"metadata": {"name": "a-keys", "labels": {API_KEY_SECRET_LABEL: "team-a"}},
             "stringData": {"k1": api_key_digest(KEY_A)}},
            {"metadata": {"name": "b-keys", "labels": {API_KEY_SECRET_LABEL: "team-b"}},
             "stringData": {"k1": api_key_digest(KEY_B)}},
        ])  # fmt: skip
        self.limits = limits or {}
        self.index = ModelIndex(services)
        self.demands: list[str] = []

    def set_services(self, services: list[ServiceView]) -> None:
        self.index = ModelIndex(services)

    def changed(self) -> None:
        self.on_change()

    async def demand(self, service: ServiceView, stamp: str) -> None:
        self.demands.append(service.key)


def service(name: str, urls: list[str], tenant: str | None = "team-a", **extra) -> ServiceView:
    endpoints = tuple(Endpoint(url, f"{name}-{i}", True, False) for i, url in enumerate(urls))
    fields = dict(namespace=f"ns-{tenant or 'shared'}", name=name, served_name=MODEL_NAME, tenant=tenant,
                  min_replicas=None, desired_replicas=len(urls), gpus_per_replica=0, endpoints=endpoints)  # fmt: skip
    return ServiceView(**(fields | extra))


class GatewayHandle:
    def __init__(self, fleet: Fleet, companions: tuple = (), **settings) -> None:
        self.fleet = fleet
        self.gateway = Gateway(GatewaySettings(**({"engine_token_master": MASTER} | settings)), fleet)
        for make_companion in companions:  # servers started on the gateway's loop (the ext_proc picker)
            self.gateway.companions.append(make_companion(self.gateway))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.gateway), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.01)

    def call_soon(self, fn) -> None:
        """Runs `fn` on the gateway's event loop (the fleet is single-threaded, like a watch)."""
        loop = self.gateway.loop
        assert loop is not None
        done = threading.Event()
        loop.call_soon_threadsafe(lambda: (fn(), done.set()))
        assert done.wait(10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@pytest.fixture
def make_gateway() -> Iterator:
    started: list[GatewayHandle] = []

    def make(fleet: Fleet, **settings) -> GatewayHandle:
        started.append(GatewayHandle(fleet, **settings))
        return started[-1]

    yield make
    for handle in started:
        handle.stop()


@pytest.fixture
def engines(make_server):
    """Two engine replicas of namespace ns-team-a: the tenant header only with the gateway's credential
    (they hold its digest), adapter loads with the namespace's internal token."""
    return [make_server(**ENGINE_TRUST) for _ in range(2)]


def samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    return [
        (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    ]


def total(url: str, name: str, **labels: str) -> float:
    return sum(v for got, v in samples(url, name) if all(got.get(k) == w for k, w in labels.items()))


def chat_body(user: str, max_tokens: int = 2, **extra) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True} | extra


def post(
    gateway: GatewayHandle, body: dict | bytes, key: str | None = KEY_A, path: str = "/v1/chat/completions"
):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(gateway.url + path, content=content, headers=headers, timeout=60, trust_env=False)


def assert_error(resp: httpx.Response, status: int, code: str, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    for word in words:
        assert word in error["message"], error
    return error


# -- routing ---------------------------------------------------------------------------------------------
def test_round_robin_spreads_and_prefix_routing_keeps_a_shared_prompt_on_one_replica(engines, make_gateway):
    urls = [e.url for e in engines]
    spread = make_gateway(HandSetFleet([service("chat", urls)]), routing="round-robin")
    for i in range(4):
        assert post(spread, chat_body(f"question {i}")).status_code == 200
    served = [total(u, counter_total(REQUEST_SUCCESS)) for u in urls]
    assert served == [2, 2], served

    affine = make_gateway(HandSetFleet([service("chat", urls)]), routing="prefix")
    before = [total(u, counter_total(REQUEST_SUCCESS)) for u in urls]
    for i in range(6):
        assert post(affine, chat_body(f"another question {i}")).status_code == 200
    after = [total(u, counter_total(REQUEST_SUCCESS)) for u in urls]
    grew = [b - a for a, b in zip(before, after, strict=True)]
    assert sorted(grew) == [0, 6], grew  # the first request picks a replica; the rest follow its prefix
    assert total(affine.url, counter_total(GATEWAY_ROUTING_DECISIONS), reason="prefix_hit") == 5
    # The predicted hits were real: the chosen engine found the shared blocks in its cache.
    chosen = urls[grew.index(6)]
    assert (
        total(chosen, counter_total(PREFIX_CACHE_HITS))
        >= total(affine.url, counter_total(GATEWAY_PREDICTED_HIT_TOKENS))
        > 0
    )


def test_streaming_passes_through_with_the_openai_client_and_the_tenant_reaches_the_engine(
    engines, make_gateway
):
    gateway = make_gateway(HandSetFleet([service("chat", [engines[0].url])]))
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY_A, max_retries=0)
    body = chat_body("stream it", max_tokens=5)
    chunks = list(client.chat.completions.create(model=body["model"], messages=body["messages"], max_tokens=5,
                                                 stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) == 5
    assert chunks[-1].choices[0].finish_reason == "length"
    # The engine counted the prompt under team-a: the gateway named the tenant with the internal token.
    assert total(engines[0].url, counter_total(TENANT_PROMPT_TOKENS), tenant="team-a") > 0
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    # `namespace/name` selects the same service; the engine gets its served name.
    assert post(gateway, chat_body("by key") | {"model": "ns-team-a/chat"}).status_code == 200


def test_a_replica_that_refuses_connections_is_retried_on_another(engines, make_gateway):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    try:
        gateway = make_gateway(
            HandSetFleet([service("chat", [dead_url, engines[0].url])]), routing="round-robin"
        )
        for i in range(4):
            assert post(gateway, chat_body(f"retry {i}")).status_code == 200
        assert total(engines[0].url, counter_total(REQUEST_SUCCESS)) == 4  # all served by the live one
        assert 1 <= total(gateway.url, counter_total(GATEWAY_RETRIES)) <= 4  # round robin tried the dead one
    finally:
        dead.close()


def test_a_client_that_disconnects_aborts_the_upstream_request(engines, make_gateway):
    engine = engines[0]
    gateway = make_gateway(HandSetFleet([service("chat", [engine.url])]))
    body = chat_body("a long answer", max_tokens=80, stream=True)
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=60, trust_env=False,
                      headers={"Authorization": f"Bearer {KEY_A}"}) as rsp:  # fmt: skip
        assert rsp.status_code == 200, rsp.read()
        next(rsp.iter_lines())  # one chunk, then hang up
    engine.assert_no_leak()  # its blocks are free and nothing runs
    # It was aborted, not run to its 80 tokens: the gateway closed the upstream stream.
    assert total(engine.url, counter_total(REQUEST_SUCCESS), finish_reason="abort") == 1
    assert gateway.gateway.router.in_flight == {}


# -- who may ask, how often --------------------------------------------------------------------------------
def test_another_tenants_model_is_not_found_as_a_name_nobody_has(engines, make_gateway):
    """A key cannot tell another tenant's names from names nobody has: the same status, headers and body
    (the name it sent in place), by bare name and by `namespace/name`, through the relay."""
    engine = engines[0]
    theirs = service("theirs", [engine.url], tenant="team-b", served_name="theirs")
    gateway = make_gateway(HandSetFleet([service("chat", [engine.url]), theirs]))

    def answer(model: str) -> tuple[int, dict, str]:
        resp = post(gateway, chat_body("hi") | {"model": model})
        headers = {k: v for k, v in resp.headers.items() if k not in ("date", "content-length")}
        return resp.status_code, headers, resp.text.replace(model, "NAME")

    for existing, absent in (("theirs", "nobodys"), ("ns-team-b/theirs", "ns-team-b/nobodys")):
        assert answer(existing) == answer(absent), existing
        assert answer(existing)[0] == 404
    assert total(engine.url, counter_total(REQUEST_SUCCESS)) == 0


def test_keys_tenants_and_bad_input_are_refused_before_any_engine_call(engines, make_gateway):
    engine = engines[0]
    other = service("theirs", [engine.url], tenant="team-b", served_name="theirs")
    gateway = make_gateway(HandSetFleet([service("chat", [engine.url]), other]), max_body_bytes=4096)
    assert_error(post(gateway, chat_body("hi"), key=None), 401, "invalid_api_key", "missing API key")
    assert_error(post(gateway, chat_body("hi"), key="fl-wrong"), 401, "invalid_api_key", "invalid API key")
    assert_error(post(gateway, chat_body("hi") | {"model": "theirs"}), 404, "model_not_found", "'theirs'")
    assert_error(post(gateway, chat_body("hi") | {"model": "nothing"}), 404, "model_not_found", "'nothing'")
    assert_error(post(gateway, b"{not json"), 400, "invalid_json", "not valid JSON")
    assert_error(post(gateway, b"[1, 2]"), 400, "invalid_json", "JSON object")
    assert_error(post(gateway, {"messages": []}), 400, "invalid_model", "'model' is required")
    assert_error(post(gateway, chat_body("x" * 5000)), 413, "request_too_large", "4096 bytes")
    # team-b's key sees only team-b's model, and never learns of team-a's.
    listed = httpx.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {KEY_B}"}).json()
    assert [m["id"] for m in listed["data"]] == ["theirs"]
    assert total(engine.url, counter_total(REQUEST_SUCCESS)) == 0  # none of it reached the engine
    codes = {labels["code"]: v for labels, v in samples(gateway.url, counter_total(GATEWAY_REQUESTS))}
    assert codes == {"401": 2, "404": 2, "400": 3, "413": 1}


def test_a_tenant_past_its_request_rate_gets_429_with_retry_after(engines, make_gateway):
    # One request of burst, refilled once in 100 s: the second and third come far sooner, however slow.
    fleet = HandSetFleet([service("chat", [engines[0].url])], limits={"team-a": RateLimits(0.01, None)})
    gateway = make_gateway(fleet)
    responses = [post(gateway, chat_body(f"fast {i}")) for i in range(3)]
    assert [r.status_code for r in responses] == [200, 429, 429]
    error = assert_error(responses[1], 429, "rate_limit_exceeded", "request")
    assert int(responses[1].headers["Retry-After"]) >= 1 and error["type"] == "rate_limit_error"
    assert total(gateway.url, counter_total(GATEWAY_RATE_LIMITED), tenant="team-a", limit="requests") >= 1


def test_the_series_of_known_models_and_limits_start_at_zero(make_gateway):
    """Before any retry, hold or refusal, a dashboard reads 0 for each model and each tenant's limit (not
    no data); a model that is not served gets no series."""
    chat = service("chat", [])
    fleet = HandSetFleet([chat], limits={"team-a": RateLimits(1.0, 600), "team-b": RateLimits()})
    gateway = make_gateway(fleet)
    gateway.call_soon(fleet.changed)
    assert samples(gateway.url, counter_total(GATEWAY_RETRIES)) == [({"model": chat.served_name}, 0.0)]
    assert samples(gateway.url, GATEWAY_HELD_REQUESTS) == [({"model": chat.served_name}, 0.0)]
    limited = sorted((labels["tenant"], labels["limit"], value)
                     for labels, value in samples(gateway.url, counter_total(GATEWAY_RATE_LIMITED)))  # fmt: skip
    assert limited == [("team-a", "requests", 0.0), ("team-a", "tokens", 0.0)]


# -- held until a replica is ready -------------------------------------------------------------------------
def test_a_request_at_zero_replicas_is_held_then_served_when_a_replica_is_ready(engines, make_gateway):
    engine = engines[0]
    cold = service("chat", [], min_replicas=0, desired_replicas=0)
    fleet = HandSetFleet([cold])
    gateway = make_gateway(fleet, heartbeat_seconds=0.05)
    results: dict[str, object] = {}

    def plain() -> None:
        results["plain"] = post(gateway, chat_body("wake up"))

    def streaming() -> None:
        body = chat_body("wake up too", stream=True)
        lines: list[str] = []
        results["lines"] = lines
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=60, trust_env=False,
                          headers={"Authorization": f"Bearer {KEY_A}"}) as rsp:  # fmt: skip
            for line in rsp.iter_lines():
                lines.append(line)
            results["stream"] = (rsp.status_code, lines)

    threads = [threading.Thread(target=plain), threading.Thread(target=streaming)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while gateway.gateway.holds.held("ns-team-a/chat") < 2 or not fleet.demands:
        assert time.monotonic() < deadline, "the requests were not held, or no demand was signalled"
        time.sleep(0.01)
    while not any(line.startswith(": waiting") for line in results.get("lines", [])):  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "no heartbeat reached the held streaming client"
        time.sleep(0.01)
    warm = replace(cold, desired_replicas=1, endpoints=(Endpoint(engine.url, "chat-0", True, False),))
    gateway.call_soon(lambda: (fleet.set_services([warm]), fleet.changed()))
    for t in threads:
        t.join(60)
    assert results["plain"].status_code == 200  # type: ignore[union-attr]
    status, lines = results["stream"]  # type: ignore[misc]
    assert status == 200 and lines[0].startswith(": waiting for a replica")
    assert lines[-2] == "data: [DONE]" or lines[-1] == "data: [DONE]"
    assert fleet.demands[0] == "ns-team-a/chat"


def test_held_requests_time_out_with_503_and_a_full_queue_or_quota_is_429(make_gateway):
    cold = service("chat", [], min_replicas=0, desired_replicas=0)
    fleet = HandSetFleet([cold])
    gateway = make_gateway(fleet, hold_timeout=0.2, max_held=1)
    timed_out = post(gateway, chat_body("anyone?"))
    assert_error(timed_out, 503, "no_replica_ready", "0.2s")
    assert timed_out.headers["Retry-After"]

    slow = make_gateway(HandSetFleet([cold]), hold_timeout=30, max_held=1)
    first = threading.Thread(target=lambda: post(slow, chat_body("first")))
    first.start()
    deadline = time.monotonic() + 30
    while slow.gateway.holds.held("ns-team-a/chat") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert_error(post(slow, chat_body("second")), 429, "hold_queue_full", "1 requests already wait")
    # The quota refuses the replica while the first waits: it is refused with the quota's message.
    refused = replace(cold, quota_refusal="tenant team-a: 1 of 1 GPUs in use")
    slow.call_soon(lambda: (slow.fleet.set_services([refused]), slow.fleet.changed()))  # type: ignore[attr-defined]
    first.join(30)
    assert_error(post(slow, chat_body("third")), 429, "insufficient_quota", "1 of 1 GPUs in use")


def test_a_service_at_zero_without_scale_from_zero_is_503_at_once(make_gateway):
    gateway = make_gateway(HandSetFleet([service("chat", [], min_replicas=None, desired_replicas=0)]))
    assert_error(post(gateway, chat_body("hello")), 503, "no_replicas", "scaled to 0")


# -- replicas lost mid-request -------------------------------------------------------------------------------
class RawReplica:
    """A hand-written replica on a raw socket: reads each request whole, answers the gateway's own GET
    lookups (tokenizer, stats) with a 404, and each POST with `respond` (counted in `served`). Unless it
    `listens`, its port is bound and refuses connections."""

    def __init__(self, listens: bool = True) -> None:
        self.served = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        if listens:
            self.sock.listen(16)
            threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                got = conn.recv(65536)
                if not got:
                    return
                data += got
            head, _, rest = data.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            length = next(
                (int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length")), 0
            )
            while len(rest) < length:
                got = conn.recv(65536)
                if not got:
                    return
                rest += got
            if not lines[0].startswith(b"POST"):
                conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                return
            self.served += 1
            self.respond(conn)

    def respond(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.sock.close()


class CuttingReplica(RawReplica):
    """A replica that answers 200 and sends `body` (SSE events, or part of a JSON body), then drops the
    connection without ending the response: what a SIGKILLed or deleted engine pod does to a request."""

    def __init__(self, body: bytes, stream: bool) -> None:
        self.body, self.stream = body, stream
        super().__init__()

    def respond(self, conn: socket.socket) -> None:
        if self.stream:  # chunked, and never the last chunk
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n"
                         + f"{len(self.body):x}\r\n".encode() + self.body + b"\r\n")  # fmt: skip
        else:  # a content-length the body never reaches
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         + f"content-length: {len(self.body) + 100}\r\n\r\n".encode() + self.body)  # fmt: skip


def chat_event(delta: dict, finish: str | None = None) -> bytes:
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": MODEL_NAME,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
    return f"data: {json.dumps(chunk)}\n\n".encode()


@pytest.mark.timeout(180)
def test_a_stream_whose_replica_dies_before_its_first_token_is_retried_and_never_fails(engines, make_gateway):
    """The replica sends 200 and the role chunk, then dies: no token reached the client, so the client
    must not see a failure; the request goes to the other replica."""
    cutter = CuttingReplica(chat_event({"role": "assistant", "content": ""}), stream=True)
    try:
        gateway = make_gateway(
            HandSetFleet([service("chat", [cutter.url, engines[0].url])]), routing="round-robin"
        )
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY_A, max_retries=0)
        for i in range(4):
            body = chat_body(f"stream {i}", max_tokens=3)
            chunks = list(client.chat.completions.create(model=body["model"], messages=body["messages"],
                          max_tokens=3, stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
            assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 3
            assert chunks[-1].choices[0].finish_reason == "length"
        assert cutter.served >= 1  # round robin did send some to the dying replica
        assert total(gateway.url, counter_total(GATEWAY_RETRIES)) == cutter.served
        assert total(gateway.url, counter_total(GATEWAY_STREAM_ERRORS)) == 0
        assert gateway.gateway.router.in_flight == {}
    finally:
        cutter.close()


@pytest.mark.timeout(180)
def test_a_whole_response_cut_before_its_end_is_retried(engines, make_gateway):
    cutter = CuttingReplica(b'{"id": "cmpl-1", "choices": [{"text": "par', stream=False)
    try:
        gateway = make_gateway(
            HandSetFleet([service("chat", [cutter.url, engines[0].url])]), routing="round-robin"
        )
        for i in range(3):
            resp = post(gateway, chat_body(f"whole {i}"))
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["finish_reason"] == "length"
        assert cutter.served >= 1
        assert gateway.gateway.router.in_flight == {}
    finally:
        cutter.close()


@pytest.mark.timeout(180)
def test_a_stream_that_loses_its_replica_after_tokens_ends_with_an_error_event_and_done(make_gateway):
    events = (
        chat_event({"role": "assistant", "content": ""})
        + chat_event({"content": "Hel"})
        + chat_event({"content": "lo"})
    )
    cutter = CuttingReplica(events, stream=True)
    try:
        gateway = make_gateway(HandSetFleet([service("chat", [cutter.url])]))
        body = chat_body("cut me", max_tokens=10, stream=True)
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=60, trust_env=False,
                          headers={"Authorization": f"Bearer {KEY_A}"}) as rsp:  # fmt: skip
            assert rsp.status_code == 200
            data = [line[6:] for line in rsp.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["code"] == "upstream_lost" and "lost after" in error["message"], error
        assert set(error) == {"message", "type", "param", "code"}
        contents = [json.loads(d)["choices"][0]["delta"].get("content") for d in data[:-2]]
        assert contents == ["", "Hel", "lo"]  # what the replica produced reached the client first
        assert total(gateway.url, counter_total(GATEWAY_STREAM_ERRORS), reason="upstream_lost") == 1
        assert gateway.gateway.router.in_flight == {}
    finally:
        cutter.close()
