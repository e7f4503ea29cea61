"""The picker's port attacked as a tenant would (issue 51): it is reachable by any pod (every InferencePool
names it), so whoever calls it with a tenant's key, with nothing, or with a guessed credential must learn no
engine and get no pick, and a data plane with the picker's credential (another GIE gateway) gets picks that
carry no credential. A subscriber that never acknowledges the engines' endpoints slows no one else's
request. Real picker, real Envoy, real engines, loopback only."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator

import grpc
import pytest

from flotilla.contract import (
    ENVOY_NODE_METADATA,
    HEADER_GATEWAY_TOKEN,
    HEADER_INTERNAL_TOKEN,
    PICKER_TOKEN_METADATA,
    engine_token,
    gateway_token,
    picker_token,
)
from flotilla.gateway.extproc.endpoints import CLA_TYPE
from flotilla.gateway.extproc.protos import (
    ClusterLoadAssignment,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)
from flotilla.gateway.proxy.bootstrap import ENGINES_CLUSTER

from ..engine.server.conftest import wait_for
from .test_extproc_envoy import make_envoy, make_front
from .test_gateway import KEY_A, MASTER, HandSetFleet, chat_body, engines, make_gateway, post, service

__all__ = ["engines", "make_envoy", "make_front", "make_gateway"]  # the fixtures, imported
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
STREAM_ENDPOINTS = "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"
_discovery = __import__("envoy.service.discovery.v3.discovery_pb2", fromlist=["DiscoveryRequest"])
DiscoveryRequest, DiscoveryResponse = _discovery.DiscoveryRequest, _discovery.DiscoveryResponse
# Every credential a tenant might hold or guess: none, its own API key, a forged value, and the digest of
# the gateway's credential it can read in an engine pod's spec.
FORGED = {
    "nothing": [],
    "api-key": [("authorization", f"Bearer {KEY_A}")],
    "forged": [(PICKER_TOKEN_METADATA, "guess")],
    "gateway-token-digest": [(PICKER_TOKEN_METADATA, __import__("hashlib").sha256(b"x").hexdigest())],
}


def exchange(body: dict) -> list:
    """The two messages Envoy sends for a buffered chat request: its headers, then its body."""
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), ("authorization", f"Bearer {KEY_A}"),
               ("content-type", "application/json")]  # fmt: skip
    header_map = HttpHeaders()
    for name, value in headers:
        header_map.headers.headers.add(key=name, raw_value=value.encode())
    first = ProcessingRequest(request_headers=header_map)
    second = ProcessingRequest()
    second.request_body.body = json.dumps(body).encode()
    second.request_body.end_of_stream = True
    return [first, second]


def process(port: int, metadata: list[tuple[str, str]]) -> list:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(
            PROCESS,
            request_serializer=ProcessingRequest.SerializeToString,
            response_deserializer=ProcessingResponse.FromString,
        )
        return list(call(iter(exchange(chat_body("who serves me?") | {"model": "ns-team-a/chat"})),
                         metadata=metadata, timeout=30))  # fmt: skip


@pytest.mark.parametrize("metadata", list(FORGED.values()), ids=list(FORGED))
def test_the_picker_refuses_every_caller_without_its_credential(engines, make_front, metadata):
    front = make_front(HandSetFleet([service("chat", [engines[0].url])]))
    with pytest.raises(grpc.RpcError) as picked:
        process(front.picker.port, metadata)
    assert picked.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert PICKER_TOKEN_METADATA in (picked.value.details() or "")
    # EDS: no endpoint listed, no subscription made.
    publisher = front.picker.endpoints
    assert publisher is not None
    before = publisher.subscribers
    with grpc.insecure_channel(f"127.0.0.1:{front.picker.port}") as channel:
        call = channel.stream_stream(
            STREAM_ENDPOINTS,
            request_serializer=DiscoveryRequest.SerializeToString,
            response_deserializer=DiscoveryResponse.FromString,
        )
        request = DiscoveryRequest(type_url=CLA_TYPE, resource_names=[ENGINES_CLUSTER])
        with pytest.raises(grpc.RpcError) as listed:
            list(call(iter([request]), metadata=metadata, timeout=30))
    assert listed.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert publisher.subscribers == before


def test_a_pick_for_a_credentialed_data_plane_carries_no_credential(engines, make_front):
    """Another GIE gateway admitted with the picker's credential: it gets the pick and the tenant's name,
    never the gateway's credential nor a namespace's internal token (its own proxy cannot add them: the
    engines then refuse the tenant name, so nothing is counted as anyone's)."""
    front = make_front(HandSetFleet([service("chat", [engines[0].url])]))
    answers = process(front.picker.port, [(PICKER_TOKEN_METADATA, picker_token(MASTER))])
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    mutation = answers[-1].request_body.response.header_mutation
    names = {h.header.key.lower() for h in mutation.set_headers}
    values = {h.header.raw_value.decode() for h in mutation.set_headers}
    assert "x-gateway-destination-endpoint" in names and "x-flotilla-tenant" in names
    assert HEADER_GATEWAY_TOKEN.lower() not in names and HEADER_INTERNAL_TOKEN.lower() not in names
    assert not values & {gateway_token(MASTER), engine_token(MASTER, "ns-team-a"), MASTER}
    assert engines[0].url.removeprefix("http://") in values


@pytest.fixture
def silent_subscriber(make_front, engines) -> Iterator:
    """A subscriber with the picker's credential that asks for the engines and never acknowledges them."""
    release = threading.Event()
    received: queue.Queue = queue.Queue()

    def requests() -> Iterator:
        yield DiscoveryRequest(type_url=CLA_TYPE, resource_names=[ENGINES_CLUSTER], node={"id": "rogue"})
        release.wait(120)  # never an ACK

    def run(port: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(
                STREAM_ENDPOINTS,
                request_serializer=DiscoveryRequest.SerializeToString,
                response_deserializer=DiscoveryResponse.FromString,
            )
            metadata = [(PICKER_TOKEN_METADATA, picker_token(MASTER)), (ENVOY_NODE_METADATA, "rogue")]
            try:
                for response in call(requests(), metadata=metadata, timeout=120):
                    received.put(response)
            except grpc.RpcError:
                pass

    threads: list[threading.Thread] = []

    def start(port: int) -> queue.Queue:
        threads.append(threading.Thread(target=run, args=(port,), daemon=True))
        threads[-1].start()
        return received

    yield start
    release.set()
    for thread in threads:
        thread.join(30)


def test_a_subscriber_that_never_acknowledges_holds_back_no_one_elses_request(
    engines, make_front, silent_subscriber
):
    front = make_front(HandSetFleet([service("chat", [engines[0].url])]))
    publisher = front.picker.endpoints
    assert publisher is not None
    address = engines[0].url.removeprefix("http://")
    wait_for(lambda: address in (publisher.acked("envoy-0") or ()), what="Envoy to apply the engines")
    received = silent_subscriber(front.picker.port)
    listed = received.get(timeout=30)  # it was answered (it holds the credential), and never ACKs
    assignment = ClusterLoadAssignment()
    assert listed.resources[0].Unpack(assignment)
    assert [e.endpoint.address.socket_address.port_value for e in assignment.endpoints[0].lb_endpoints] == [
        int(address.rsplit(":", 1)[1])
    ]
    wait_for(lambda: publisher.subscribers == 2, what="the silent subscriber")
    assert publisher.acked("rogue") == frozenset()
    for i in range(3):  # each would have waited for the silent subscriber's ACK, then got 503
        answer = post(front, chat_body(f"still served {i}"))
        assert answer.status_code == 200, answer.text
