"""The picker's pure parts: decisions as ext_proc messages (extproc/responses.py), the health statuses, and
Envoy's bootstrap (proxy/bootstrap.py). No network; test_extproc_envoy.py runs them behind a real Envoy."""

from __future__ import annotations

import json

import pytest

from flotilla.contract import (
    DESTINATION_ENDPOINT_HEADER,
    DESTINATION_METADATA_NAMESPACE,
    ENVOY_NODE_METADATA,
    HEADER_GATEWAY_TOKEN,
    HEADER_TENANT,
    PICKER_TOKEN_METADATA,
    SUBSET_HINT_KEY,
    SUBSET_HINT_NAMESPACE,
    gateway_token,
    picker_token,
)
from flotilla.gateway.config import HOLD_MARGIN_SECONDS
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.extproc import health, responses
from flotilla.gateway.extproc.protos import HeaderValue, HttpHeaders, ProcessingRequest, Struct
from flotilla.gateway.proxy.bootstrap import ENGINES_CLUSTER, PICKER_CLUSTER, bootstrap, processing_mode


def set_headers(mutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def test_a_refusal_is_an_immediate_response_with_the_relays_status_headers_and_body():
    error = GatewayError(429, "slow down", code="rate_limit_exceeded", headers={"Retry-After": "7"})
    answer = responses.refusal(error).immediate_response
    assert answer.status.code == 429
    assert set_headers(answer.headers) == {"content-type": "application/json", "retry-after": "7"}
    assert json.loads(answer.body) == error.body()
    assert json.loads(answer.body)["error"]["type"] == "rate_limit_error"
    assert answer.details == "flotilla_rate_limit_exceeded"


def test_a_pick_names_the_endpoint_in_the_header_and_the_metadata_and_drops_the_clients_credentials():
    trusted = {HEADER_TENANT: "team-a", "content-type": "application/json"}
    client = ["authorization", "x-flotilla-tenant", "X-Flotilla-Internal-Token", "user-agent"]
    answer = responses.picked("10.0.0.7:8000", trusted, client, None)
    common = answer.request_body.response
    headers = set_headers(common.header_mutation)
    assert headers[DESTINATION_ENDPOINT_HEADER] == "10.0.0.7:8000"
    assert headers[HEADER_TENANT.lower()] == "team-a"
    # What the picker sets is overwritten, not removed; the key and other claims to be the gateway go.
    assert sorted(common.header_mutation.remove_headers) == ["authorization", "x-flotilla-internal-token"]
    assert not common.HasField("body_mutation") and "content-length" not in headers
    metadata = answer.dynamic_metadata.fields[DESTINATION_METADATA_NAMESPACE].struct_value
    assert metadata.fields[DESTINATION_ENDPOINT_HEADER].string_value == "10.0.0.7:8000"


def test_a_rewritten_body_goes_with_its_new_length():
    answer = responses.picked("10.0.0.7:8000", {}, [], b'{"model":"chat"}')
    common = answer.request_body.response
    assert common.body_mutation.body == b'{"model":"chat"}'
    assert set_headers(common.header_mutation)["content-length"] == "16"


def request_with_subset(value) -> object:
    request = ProcessingRequest()
    hint = Struct()
    hint.update({SUBSET_HINT_KEY: value})
    request.metadata_context.filter_metadata[SUBSET_HINT_NAMESPACE].CopyFrom(hint)
    return request


def test_the_subset_hint_is_read_as_a_list_or_a_comma_separated_string():
    assert responses.subset_hint(ProcessingRequest()) is None
    assert responses.subset_hint(request_with_subset(["10.0.0.1:8000", "10.0.0.2:8000"])) == {
        "10.0.0.1:8000",
        "10.0.0.2:8000",
    }
    assert responses.subset_hint(request_with_subset("10.0.0.1:8000, 10.0.0.2:8000")) == {
        "10.0.0.1:8000",
        "10.0.0.2:8000",
    }
    assert responses.subset_hint(request_with_subset([])) == frozenset()  # nothing may be picked


def test_headers_are_read_lower_cased_from_raw_values():
    message = HttpHeaders()
    message.headers.headers.extend([HeaderValue(key=":path", raw_value=b"/v1/completions"),
                                    HeaderValue(key="Authorization", value="Bearer k")])  # fmt: skip
    assert responses.headers_of(message) == {":path": "/v1/completions", "authorization": "Bearer k"}


@pytest.mark.parametrize(
    ("url", "address"),
    [("http://10.1.2.3:8000", "10.1.2.3:8000"), ("http://10.1.2.3", "10.1.2.3:80"),
     ("http://[fd00::1]:8000", "[fd00::1]:8000")],
)  # fmt: skip
def test_an_engine_url_becomes_the_protocols_address(url, address):
    assert responses.endpoint_address(url) == address


def test_a_held_request_asks_envoy_for_a_longer_timeout():
    answer = responses.extend_timeout(90.5)
    assert answer.WhichOneof("response") is None  # the override alone, as Envoy requires
    assert (
        answer.override_message_timeout.seconds == 90 and answer.override_message_timeout.nanos == 5 * 10**8
    )


def test_health_statuses():
    assert health.status_of(health.LIVENESS, ready=False) == health.SERVING
    assert health.status_of(health.READINESS, ready=False) == health.NOT_SERVING
    assert health.status_of(health.EXT_PROC_SERVICE, ready=True) == health.SERVING
    assert health.status_of("", ready=True) == health.SERVING
    assert health.status_of("something-else", ready=True) is None
    wire = health.HealthCheckResponse(status=health.SERVING).SerializeToString()
    assert wire == b"\x08\x01"  # field 1, varint 1: the standard's encoding


def test_the_bootstrap_wires_ext_proc_to_the_picker_and_the_router_to_the_picked_endpoint():
    config = bootstrap(picker_host="10.0.0.9", picker_port=9002, failure_mode="FailClose", hold_timeout=100,
                       master_token="m", node_id="gw-1")  # fmt: skip
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in manager["http_filters"]]
    assert names == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    # A client's own tenant and gateway credential go before the picker sees the request.
    removed = manager["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]
    assert removed == [{"remove": HEADER_TENANT.lower()}, {"remove": HEADER_GATEWAY_TOKEN.lower()}]
    ext_proc = manager["http_filters"][1]["typed_config"]
    assert ext_proc["failure_mode_allow"] is False
    picker_service = {
        "envoy_grpc": {"cluster_name": PICKER_CLUSTER},
        "initial_metadata": [
            {"key": PICKER_TOKEN_METADATA, "value": picker_token("m")},
            {"key": ENVOY_NODE_METADATA, "value": "gw-1"},
        ],
    }
    assert ext_proc["grpc_service"] == picker_service
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ext_proc["max_message_timeout"] == f"{100 + HOLD_MARGIN_SECONDS:g}s"
    assert ext_proc["metadata_options"]["forwarding_namespaces"]["untyped"] == [SUBSET_HINT_NAMESPACE]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert clusters[PICKER_CLUSTER]["type"] == "STATIC"
    engines = clusters[ENGINES_CLUSTER]
    # The engines come from the picker (EDS); override-host sends a request to the pick, then its fallback.
    assert engines["type"] == "EDS"
    eds = engines["eds_cluster_config"]["eds_config"]["api_config_source"]
    assert eds["grpc_services"] == [picker_service]
    override = engines["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert override["name"] == "envoy.load_balancing_policies.override_host"
    sources = override["typed_config"]["override_host_sources"]
    assert {"header": DESTINATION_ENDPOINT_HEADER} in sources
    entry = manager["route_config"]["virtual_hosts"][0]["routes"][0]
    # The gateway's credential is the route's own header: a client's is removed first, then Envoy's added.
    assert entry["request_headers_to_remove"] == [HEADER_GATEWAY_TOKEN.lower()]
    (added,) = entry["request_headers_to_add"]
    assert added["header"] == {"key": HEADER_GATEWAY_TOKEN.lower(), "value": gateway_token("m")}
    route = entry["route"]
    assert (
        route["retry_policy"]["num_retries"] == 1 and 503 in route["retry_policy"]["retriable_status_codes"]
    )
    assert config["node"]["id"] == "gw-1"  # xDS needs a node identity; the picker keeps nodes apart
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    opened = bootstrap(picker_host="flotilla-gateway", picker_port=9002, failure_mode="FailOpen")
    opened_manager = opened["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    assert opened_manager["http_filters"][1]["typed_config"]["failure_mode_allow"] is True
    # Without a master token: no credential anywhere, and a client's is still removed.
    assert PICKER_TOKEN_METADATA not in json.dumps(opened)
    assert "request_headers_to_add" not in opened_manager["route_config"]["virtual_hosts"][0]["routes"][0]
    assert opened["static_resources"]["clusters"][0]["type"] == "STRICT_DNS"
    with pytest.raises(ValueError, match="failure_mode"):
        bootstrap(picker_host="x", picker_port=1, failure_mode="Sometimes")  # type: ignore[arg-type]


def test_in_full_duplex_mode_the_pick_answers_the_headers_and_hands_the_body_back():
    headers, body = responses.picked_streamed(
        "10.0.0.7:8000", {}, ["authorization"], b'{"model":"chat"}', True
    )
    mutation = headers.request_headers.response.header_mutation
    assert set_headers(mutation) == {DESTINATION_ENDPOINT_HEADER: "10.0.0.7:8000", "content-length": "16"}
    assert list(mutation.remove_headers) == ["authorization"]
    assert (
        headers.dynamic_metadata.fields[DESTINATION_METADATA_NAMESPACE]
        .struct_value.fields[DESTINATION_ENDPOINT_HEADER]
        .string_value
        == "10.0.0.7:8000"
    )
    streamed = body.request_body.response.body_mutation.streamed_response
    assert streamed.body == b'{"model":"chat"}' and streamed.end_of_stream
    echoed = responses.streamed_body(b"data: {}\n\n", False, request_phase=False)
    assert echoed.response_body.response.body_mutation.streamed_response.body == b"data: {}\n\n"


def test_the_processing_modes():
    assert processing_mode("BUFFERED")["request_body_mode"] == "BUFFERED"
    assert processing_mode("BUFFERED")["response_body_mode"] == "STREAMED"
    duplex = processing_mode("FULL_DUPLEX_STREAMED")
    assert duplex["request_body_mode"] == duplex["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert duplex["request_trailer_mode"] == duplex["response_trailer_mode"] == "SEND"
    with pytest.raises(ValueError, match="body_mode"):
        processing_mode("STREAMED")  # type: ignore[arg-type]
