"""Envoy's external processor: one gRPC stream per HTTP request, answered with the front door's rules
(admission.py, the same calls the relay makes) and the picker's choice of engine.

The phases Envoy sends (proxy/bootstrap.py's processing mode):

- request headers: the API key (401) and the declared size (413) are checked at once; `GET /v1/models`
  is answered here; a path that is not the OpenAI API's is a 404.
- request body (buffered whole): its size, JSON, model, tenancy and rate limits; a service without a ready
  replica is refused (quota 429, 503) or held until one is Ready (Envoy is asked to wait that long, with
  `override_message_timeout`); then the prompt is hashed and an engine picked by prefix and load, among the
  data plane's subset when it sent one (503 when none of them is ready).
- response headers: the status, for the requests series and the upstream time to first byte.
- response body (streamed): the completion's events (a stream) or its usage (a whole body), charged to
  the tenant's token limits as the relay charges them.

The engine's in-flight count (the load the router weighs) rises at the pick and falls when the stream
ends, however it ends: the response's end, the client going away (Envoy closes the stream), an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from flotilla.contract import OPENAI_PATH
from flotilla.gateway.admission import CHAT_COMPLETIONS, COMPLETIONS, Admitted, FrontDoor, count_events
from flotilla.gateway.config import HOLD_MARGIN_SECONDS
from flotilla.gateway.core.services import routable
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.extproc import callers, responses
from flotilla.gateway.extproc.endpoints import EndpointPublisher
from flotilla.gateway.extproc.protos import FULL_DUPLEX_STREAMED, ExternalProcessorServicer
from flotilla.gateway.upstream import tenant_headers

log = logging.getLogger("flotilla.gateway.extproc")
MODELS = OPENAI_PATH + "/models"
CLIENT_CLOSED = 499  # nginx's "client closed request", as the relay counts it
MAX_WHOLE_BODY = 1 << 20  # a whole (not streamed) response is read for its usage up to this size
ENDPOINTS_WAIT_SECONDS = 10.0  # Envoy applies an endpoint update in milliseconds; a busy machine, longer
ATTEMPT_COUNT_HEADER = "x-envoy-attempt-count"  # the bootstrap asks Envoy to set it on responses


class PickerStream:
    """One HTTP request's exchange with Envoy: what was learned in earlier phases, and its engine."""

    def __init__(
        self, door: FrontDoor, endpoints: EndpointPublisher | None = None, node: str | None = None
    ) -> None:
        self.door, self.endpoints = door, endpoints
        self.node = node  # the asking Envoy's node id: its picks wait only for its own EDS ACKs
        self.arrival = time.perf_counter()
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.tenant: str | None = None
        self.chat = False
        self.body = bytearray()
        self.admitted: Admitted | None = None
        self.labels = {"tenant": "", "model": ""}  # only names the gateway knows: never a client's free text
        self.url: str | None = None  # the picked engine, in flight until finish()
        self.sent = 0.0
        self.events = 0
        self.whole = bytearray()
        self.counted = False
        # Full-duplex streaming (GIE's reference mode) instead of a buffered request body / a streamed
        # response body: Envoy then sends on only the bodies handed back to it.
        self.duplex = self.duplex_response = False

    async def answer(self, request: Any) -> AsyncIterator[Any]:
        """The responses to one message (an extension of Envoy's timeout may come before the answer)."""
        phase = request.WhichOneof("request")
        if request.HasField("protocol_config"):  # the first message says how Envoy sends bodies
            self.duplex = request.protocol_config.request_body_mode == FULL_DUPLEX_STREAMED
            self.duplex_response = request.protocol_config.response_body_mode == FULL_DUPLEX_STREAMED
        try:
            if phase == "request_headers":
                response = self.request_headers(request)
                if response is not None:
                    yield response
            elif phase == "request_body":
                async for response in self.request_body(request):
                    yield response
            elif phase == "response_headers":
                yield self.response_headers(request)
            elif phase == "response_body":
                yield self.response_body(request)
            elif phase in ("request_trailers", "response_trailers"):  # full-duplex mode sends them on
                yield responses.continue_trailers(request_phase=phase == "request_trailers")
            else:
                log.warning("unexpected ext_proc message %s", phase)
        except GatewayError as error:
            self.count(error.status)
            yield responses.refusal(error)

    # -- the request ----------------------------------------------------------------------------------
    def request_headers(self, request: Any) -> Any | None:
        self.headers = responses.headers_of(request.request_headers)
        self.subset = responses.subset_hint(request)
        method, path = self.headers.get(":method", ""), self.headers.get(":path", "").split("?")[0]
        self.tenant = self.door.authenticate(self.headers.get("authorization"))
        self.labels["tenant"] = self.tenant or ""
        if method == "GET" and path == MODELS:
            self.count(200)
            return responses.immediate_json(200, self.door.model_list(self.tenant))
        if method != "POST" or path not in (COMPLETIONS, CHAT_COMPLETIONS):
            raise GatewayError(404, f"no such endpoint: {method} {path}; the gateway serves POST "
                               f"{COMPLETIONS}, POST {CHAT_COMPLETIONS} and GET {MODELS}",
                               code="unknown_url")  # fmt: skip
        self.chat = path == CHAT_COMPLETIONS
        self.door.check_declared_size(self.headers.get("content-length"))
        if request.request_headers.end_of_stream:  # no body: the JSON check refuses it
            self.door.check(self.tenant, b"", self.chat)
        if self.duplex:
            return None  # answered with the pick, once the body is read
        return responses.continue_headers(request_phase=True)

    async def request_body(self, request: Any) -> AsyncIterator[Any]:
        self.body += request.request_body.body
        self.door.check_size(len(self.body))
        if not request.request_body.end_of_stream:
            if not self.duplex:  # buffered mode sends one message; a part of a streamed one is passed on
                yield responses.continue_body(request_phase=True)
            return
        door = self.door
        admitted = self.admitted = await door.admit(self.tenant, bytes(self.body), self.chat)
        service = admitted.service
        self.labels["model"] = service.served_name
        if not routable(service):
            door.check_can_wait(service)
            yield responses.extend_timeout(door.settings.hold_timeout + HOLD_MARGIN_SECONDS)
            held_at = time.perf_counter()
            await door.wait_for_replica(service)
            door.metrics.cold_start.labels(service.served_name).observe(time.perf_counter() - held_at)
            self.arrival += time.perf_counter() - held_at  # the added latency does not count the hold
            service = admitted.service = door.fleet.index.get(service.key) or service
        prompt = await door.prompt(admitted)
        service = await self.known_to_envoy(service)
        candidates = {e.url for e in routable(service)}
        excluded = (
            {url for url in candidates if responses.endpoint_address(url) not in self.subset}
            if self.subset is not None
            else set()
        )
        excluded |= self.unknown_to_envoy(candidates)
        decision = door.router.choose(service, prompt.hashes, excluded, prompt.blocks_per_replica)
        if decision is None:
            if self.subset is not None:
                raise GatewayError(503, f"none of the {len(self.subset)} endpoints the gateway allowed for "
                                   f"this request is a ready replica of {service.served_name!r}",
                                   code="no_replica_ready", headers={"Retry-After": "1"})  # fmt: skip
            raise GatewayError(503, f"no ready replica of {service.served_name!r}; retry later",
                               code="no_replica_ready", headers={"Retry-After": "1"})  # fmt: skip
        self.url = decision.endpoint.url
        door.router.started(self.url)
        door.metrics.decisions.labels(decision.reason).inc()
        door.count_prompt(prompt, decision)
        self.sent = time.perf_counter()
        door.metrics.added_latency.observe(self.sent - self.arrival)
        trusted = tenant_headers(self.tenant, door.settings.engine_token_master)
        address = responses.endpoint_address(self.url)
        fallback = door.router.fallback(service, excluded | {self.url})
        if fallback is not None:  # where Envoy retries a request the pick refused or reset before answering
            address += "," + responses.endpoint_address(fallback)
        rewritten = admitted.content != bytes(self.body)
        if self.duplex:
            for response in responses.picked_streamed(
                address, trusted, self.headers, admitted.content, rewritten
            ):
                yield response
        else:
            yield responses.picked(address, trusted, self.headers, admitted.content if rewritten else None)

    def unknown_to_envoy(self, urls: set[str]) -> set[str]:
        """The engines the asking Envoy has not applied yet (its cluster lacks them)."""
        acked = self.endpoints.acked(self.node) if self.endpoints is not None else None
        return set() if acked is None else {u for u in urls if responses.endpoint_address(u) not in acked}

    async def known_to_envoy(self, service: Any) -> Any:
        """A replica that just became ready may not be in Envoy's cluster yet: wait (briefly) until one
        ready replica is, and return the service as the fleet has it then."""
        urls = {e.url for e in routable(service)}
        if self.endpoints is None or not urls or self.unknown_to_envoy(urls) != urls:
            return service
        addresses = {responses.endpoint_address(u) for u in urls}
        await self.endpoints.wait_acked(addresses, ENDPOINTS_WAIT_SECONDS, self.node)
        return self.door.fleet.index.get(service.key) or service

    # -- the response ---------------------------------------------------------------------------------
    def response_headers(self, request: Any) -> Any:
        headers = responses.headers_of(request.response_headers)
        status = headers.get(":status", "0")
        self.count(int(status) if status.isdigit() else 0)
        if self.admitted is not None:
            model = self.admitted.service.served_name
            waited = time.perf_counter() - self.sent
            self.door.metrics.upstream_ttfb.labels(model).observe(waited)
            attempts = headers.get(ATTEMPT_COUNT_HEADER, "1")
            if attempts.isdigit() and int(attempts) > 1:  # Envoy retried the pick on its fallback
                self.door.metrics.retries.labels(model).inc(int(attempts) - 1)
        if request.response_headers.end_of_stream:
            self.finish()
        return responses.continue_headers(request_phase=False)

    def response_body(self, request: Any) -> Any:
        chunk = request.response_body.body
        if self.admitted is not None and self.admitted.stream:
            self.events += count_events(chunk)
        elif len(self.whole) + len(chunk) <= MAX_WHOLE_BODY:
            self.whole += chunk
        if request.response_body.end_of_stream:
            self.finish()
        if self.duplex_response:
            return responses.streamed_body(chunk, request.response_body.end_of_stream, request_phase=False)
        return responses.continue_body(request_phase=False)

    # -- the end --------------------------------------------------------------------------------------
    def count(self, status: int) -> None:
        if not self.counted:
            self.counted = True
            self.door.metrics.requests.labels(self.labels["tenant"], self.labels["model"], str(status)).inc()

    def finish(self) -> None:
        """The request is over (idempotent): its engine's in-flight count falls, its completion is charged."""
        if self.url is not None:
            self.door.router.finished(self.url)
            self.url = None
            if self.admitted is not None and self.admitted.stream:
                self.door.charge_events(self.tenant, self.events)
            elif self.whole:
                self.door.charge_completion(self.tenant, bytes(self.whole))


class Picker(ExternalProcessorServicer):
    def __init__(self, door: FrontDoor, endpoints: EndpointPublisher | None = None) -> None:
        self.door, self.endpoints = door, endpoints

    async def Process(  # noqa: N802  (the gRPC method's name)
        self, request_iterator: AsyncIterator[Any], context: object
    ) -> AsyncIterator[Any]:
        stream = PickerStream(self.door, self.endpoints, callers.envoy_node(context))
        try:
            async for request in request_iterator:
                async for response in stream.answer(request):
                    yield response
                    if response.WhichOneof("response") == "immediate_response":
                        return
        finally:  # the response ended, the client went away, or Envoy closed the stream
            if stream.headers:
                stream.count(CLIENT_CLOSED)  # no answer was counted: the client left first
            stream.finish()
