"""The picker's answers to Envoy, as ext_proc messages, and what it reads of Envoy's requests. Pure: no I/O,
no state; tests/gateway/test_extproc_responses.py checks each.

- A refusal (a GatewayError: 401, 403, 404, 413, 429 with Retry-After, 503...) is an ImmediateResponse
  with the error's status, headers and OpenAI-shaped JSON body, exactly as the relay answers it.
- A pick is the request body's answer: a header mutation that names the engine in
  `x-gateway-destination-endpoint` (`ip:port`, then a fallback's `,ip:port` when the service has another
  ready replica: the one Envoy retries on), sets the headers engines trust only from the gateway
  (upstream.upstream_headers) and drops the client's own (its API key, any X-Flotilla-* it sent), plus the
  same endpoint in the `envoy.lb` dynamic metadata; and, when the body was rewritten (a `namespace/name`
  model becomes the served name), the new body and its length.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from flotilla.contract import (
    DESTINATION_ENDPOINT_HEADER,
    DESTINATION_METADATA_NAMESPACE,
    SUBSET_HINT_KEY,
    SUBSET_HINT_NAMESPACE,
)
from flotilla.gateway.extproc.protos import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    Duration,
    HeaderMutation,
    HeadersResponse,
    HeaderValue,
    HeaderValueOption,
    HttpStatus,
    ImmediateResponse,
    ProcessingResponse,
    StreamedBodyResponse,
    Struct,
    TrailersResponse,
)
from flotilla.openai_errors import OpenAIError

OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# Client headers the engine must not see: the API key, and anything claiming to be the gateway's.
DROPPED_PREFIX = "x-flotilla-"  # HEADER_TENANT, HEADER_INTERNAL_TOKEN, ...


def headers_of(message: Any) -> dict[str, str]:
    """An ext_proc header map as lower-case name -> value (Envoy sends `raw_value`; the last one wins)."""
    found: dict[str, str] = {}
    for header in message.headers.headers:
        value = header.raw_value.decode("latin-1") if header.raw_value else header.value
        found[header.key.lower()] = value
    return found


def subset_hint(request: Any) -> frozenset[str] | None:
    """The data plane's subset (`ip:port` endpoints the pick must come from), or None when it sent none.
    An empty list is a subset too: nothing may be picked."""
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_HINT_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_HINT_NAMESPACE].fields
    if SUBSET_HINT_KEY not in fields:
        return None
    value = fields[SUBSET_HINT_KEY]
    if value.WhichOneof("kind") == "list_value":
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    # Not the protocol's list: accept a comma-separated string, as the destination header's own format.
    return frozenset(part.strip() for part in value.string_value.split(",") if part.strip())


def endpoint_address(url: str) -> str:
    """An engine's base URL as the protocol's `host:port` (pods are addressed by IP)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}"


def _header(name: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=name, raw_value=value.encode()), append_action=OVERWRITE)


def refusal(error: OpenAIError) -> Any:
    """A refusal as Envoy answers it to the client, without an upstream call."""
    headers = {"content-type": "application/json"} | {k.lower(): v for k, v in (error.headers or {}).items()}
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=error.status),  # the enum's values are the codes
            headers=HeaderMutation(set_headers=[_header(k, v) for k, v in headers.items()]),
            body=json.dumps(error.body()).encode(),
            details=f"flotilla_{error.code or 'refused'}",
        )
    )


def immediate_json(status: int, payload: object) -> Any:
    """An answer the picker gives itself (the model list)."""
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=status),
            headers=HeaderMutation(set_headers=[_header("content-type", "application/json")]),
            body=json.dumps(payload).encode(),
            details="flotilla_answered",
        )
    )


def continue_headers(request_phase: bool) -> Any:
    if request_phase:
        return ProcessingResponse(request_headers=HeadersResponse(response=CommonResponse()))
    return ProcessingResponse(response_headers=HeadersResponse(response=CommonResponse()))


def continue_body(request_phase: bool) -> Any:
    if request_phase:
        return ProcessingResponse(request_body=BodyResponse(response=CommonResponse()))
    return ProcessingResponse(response_body=BodyResponse(response=CommonResponse()))


def continue_trailers(request_phase: bool) -> Any:
    if request_phase:
        return ProcessingResponse(request_trailers=TrailersResponse())
    return ProcessingResponse(response_trailers=TrailersResponse())


def streamed_body(chunk: bytes, end_of_stream: bool, request_phase: bool) -> Any:
    """Full-duplex streaming: a body chunk handed back to Envoy, which sends on only what it is given."""
    common = CommonResponse(
        body_mutation=BodyMutation(
            streamed_response=StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
        )
    )
    if request_phase:
        return ProcessingResponse(request_body=BodyResponse(response=common))
    return ProcessingResponse(response_body=BodyResponse(response=common))


def extend_timeout(seconds: float) -> Any:
    """Asks Envoy to wait this long for the current message's answer (a request held for a replica); Envoy
    caps it at the filter's max_message_timeout."""
    whole = int(seconds)
    return ProcessingResponse(
        override_message_timeout=Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    )


def picked(
    address: str,
    trusted: Mapping[str, str],
    client_headers: Iterable[str],
    new_body: bytes | None,
) -> Any:
    """The answer to a request's (buffered) body once an engine is picked: see the module's docstring.
    `trusted` are the headers the gateway sets for the engine; `client_headers` the names the client sent."""
    mutation, body_mutation = _pick_mutation(address, trusted, client_headers, new_body)
    common = CommonResponse(
        status=CommonResponse.CONTINUE, header_mutation=mutation, body_mutation=body_mutation
    )
    return ProcessingResponse(request_body=BodyResponse(response=common), dynamic_metadata=_metadata(address))


def picked_streamed(
    address: str, trusted: Mapping[str, str], client_headers: Iterable[str], body: bytes, rewritten: bool
) -> list[Any]:
    """The same pick in full-duplex streaming mode (GIE's reference processing mode): Envoy waits for the
    request headers' answer, which comes once the whole body is read, then gets the body back."""
    mutation, _ = _pick_mutation(address, trusted, client_headers, body if rewritten else None)
    headers = ProcessingResponse(
        request_headers=HeadersResponse(response=CommonResponse(header_mutation=mutation)),
        dynamic_metadata=_metadata(address),
    )
    return [headers, streamed_body(body, True, request_phase=True)]


def _pick_mutation(
    address: str, trusted: Mapping[str, str], client_headers: Iterable[str], new_body: bytes | None
) -> tuple[Any, Any]:
    setting = {DESTINATION_ENDPOINT_HEADER: address} | {k.lower(): v for k, v in trusted.items()}
    removed = sorted(
        name
        for name in {h.lower() for h in client_headers}
        if name not in setting and (name == "authorization" or name.startswith(DROPPED_PREFIX))
    )
    body_mutation = None
    if new_body is not None:
        setting["content-length"] = str(len(new_body))
        body_mutation = BodyMutation(body=new_body)
    mutation = HeaderMutation(set_headers=[_header(k, v) for k, v in setting.items()], remove_headers=removed)
    return mutation, body_mutation


def _metadata(address: str) -> Any:
    metadata = Struct()
    metadata.update({DESTINATION_METADATA_NAMESPACE: {DESTINATION_ENDPOINT_HEADER: address}})
    return metadata
