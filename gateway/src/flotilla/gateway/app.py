"""The gateway's HTTP app: `/v1/completions`, `/v1/chat/completions` and `/v1/models` for every
InferenceService and LoRA adapter (LoRAAdapter objects: a request's "model" names one like a served model;
it goes to its base service's replicas where the operator has loaded it), `/health` and `/metrics` of its
own.

A request passes, in order and before any upstream call, the front door's rules (admission.py, shared
with the ext_proc picker that serves Envoy): its API key (401), its size (413), its JSON (400), its model
(404, or 403 for another tenant's), its tenant's rate limits (429), the service's quota (429). Then it is routed (prefix and load, router.py) and relayed, streamed chunk by chunk; or, when the service
has no ready replica but will get one (scale from zero, a restart), held until one is Ready, with SSE
comment heartbeats to a streaming client. A client that goes away aborts the upstream request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from flotilla.contract import HEALTH_PATH, METRICS_PATH, OPENAI_PATH
from flotilla.disconnect import ClientDisconnected, until_disconnected
from flotilla.gateway.admission import Admitted, FrontDoor, count_events
from flotilla.gateway.config import GatewaySettings
from flotilla.gateway.core.services import ServiceView, routable
from flotilla.gateway.engine_stats import EngineStats
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.fleet import Fleet
from flotilla.gateway.upstream import CONNECTION_LOST, Exchange, send, upstream_headers

PASSED_RESPONSE_HEADERS = ("content-type", "retry-after", "x-request-id")


class Companion(Protocol):
    async def start(self) -> Any: ...

    async def stop(self) -> None: ...


class Gateway:
    """The HTTP relay over the front door's rules (admission.py), which it shares with the picker."""

    def __init__(self, settings: GatewaySettings, fleet: Fleet, stats: EngineStats | None = None) -> None:
        self.settings, self.fleet = settings, fleet
        self.door = FrontDoor(settings, fleet, stats)
        self.metrics, self.router, self.holds = self.door.metrics, self.door.router, self.door.holds
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=settings.upstream_timeout, write=30.0, pool=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop: watches and requests run on it
        # Servers started and stopped with the app, on its loop (the ext_proc picker: extproc/server.py).
        self.companions: list[Companion] = []

    # -- the endpoints --------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self.serve(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self.serve(request, chat=True)

    async def models(self, request: Request) -> Response:
        try:
            tenant = self.door.authenticate(request.headers.get("authorization"))
        except GatewayError as error:
            return error.response()
        return JSONResponse(self.door.model_list(tenant))

    async def health(self, _request: Request) -> Response:
        ready = self.fleet.synced.is_set()
        return JSONResponse({"status": "ok" if ready else "starting"}, status_code=200 if ready else 503)

    async def metrics_page(self, _request: Request) -> Response:
        for service in [*self.fleet.index.services(), *self.fleet.index.adapters()]:
            self.metrics.held.labels(service.served_name).set(self.holds.held(service.key))
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- one OpenAI request ---------------------------------------------------------------------------
    async def serve(self, request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        labels = {"tenant": "", "model": ""}  # only names the gateway knows: never a client's free text
        try:
            response = await self._serve(request, chat, arrival, labels)
        except GatewayError as error:
            response = error.response()
        except ClientDisconnected:  # while the gateway waited for something on its behalf
            response = Response(status_code=499)  # nginx's "client closed request": nobody reads it
        self.metrics.requests.labels(labels["tenant"], labels["model"], str(response.status_code)).inc()
        return response

    async def _serve(self, request: Request, chat: bool, arrival: float, labels: dict[str, str]) -> Response:
        tenant = self.door.authenticate(request.headers.get("authorization"))
        labels["tenant"] = tenant or ""
        admitted = await self.door.admit(tenant, await self.read_body(request), chat)
        service, content, body, path = admitted.service, admitted.content, admitted.body, admitted.path
        labels["model"] = service.served_name
        stream = admitted.stream
        if not routable(service):
            self.door.check_can_wait(service)
            if stream:
                return StreamingResponse(
                    self.held_stream(request, service, tenant, path, content, body, chat),
                    media_type="text/event-stream",
                )
            held_at = time.perf_counter()
            await until_disconnected(self.door.wait_for_replica(service), request.receive)
            arrival += time.perf_counter() - held_at  # the added latency does not count the hold
            cold_start = time.perf_counter() - held_at
            exchange = await until_disconnected(
                self.open(service, tenant, path, content, body, chat, arrival),
                request.receive,
                Exchange.close,
            )
            self.metrics.cold_start.labels(service.served_name).observe(cold_start)
        else:
            exchange = await until_disconnected(
                self.open(service, tenant, path, content, body, chat, arrival),
                request.receive,
                Exchange.close,
            )
        if stream and exchange.response.status_code == 200:
            return StreamingResponse(self.relay(exchange, tenant), status_code=200,
                                     headers=passed_headers(exchange.response))  # fmt: skip
        try:
            data = (
                exchange.head
                if exchange.complete
                else await until_disconnected(exchange.response.aread(), request.receive)
            )
        finally:
            await exchange.close()
        self.door.charge_completion(tenant, data)
        return Response(
            data, status_code=exchange.response.status_code, headers=passed_headers(exchange.response)
        )

    async def read_body(self, request: Request) -> bytes:
        self.door.check_declared_size(request.headers.get("content-length"))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            self.door.check_size(size)
            chunks.append(chunk)
        return b"".join(chunks)

    async def open(
        self, service: ServiceView, tenant: str | None, path: str, content: bytes, body: dict, chat: bool,
        arrival: float,
    ) -> Exchange:  # fmt: skip
        """Tokenize and hash the prompt, route, send; the prompt's tokens are charged to the tenant."""
        admitted = Admitted(tenant, service, body, content, chat)
        prompt = await self.door.prompt(admitted)
        headers = upstream_headers(tenant, self.settings.engine_token_master)
        sent = time.perf_counter()
        self.metrics.added_latency.observe(sent - arrival)
        key = service.key
        exchange = await send(self.client, self.router, lambda: self.fleet.index.get(key), path, content, headers,
                              prompt.hashes, prompt.blocks_per_replica, self.metrics,
                              service.served_name, admitted.stream,
                              retry_not_found=service.adapter is not None)  # fmt: skip
        self.metrics.upstream_ttfb.labels(service.served_name).observe(time.perf_counter() - sent)
        self.door.count_prompt(prompt, exchange.decision)
        return exchange

    async def held_stream(
        self, request: Request, service: ServiceView, tenant: str | None, path: str, content: bytes, body: dict,
        chat: bool,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """A streaming request held for a replica: heartbeats while it waits, then the upstream stream; an
        error after the 200 went out is one SSE error event."""
        held_at = time.perf_counter()
        waiting = asyncio.ensure_future(self.door.wait_for_replica(service))
        try:
            while not waiting.done():
                done, _ = await asyncio.wait({waiting}, timeout=self.settings.heartbeat_seconds)
                if not done:
                    yield f": waiting for a replica of {service.served_name}\n\n".encode()
            waiting.result()
            cold_start = time.perf_counter() - held_at
            exchange = await self.open(service, tenant, path, content, body, chat, time.perf_counter())
            self.metrics.cold_start.labels(service.served_name).observe(cold_start)
        except GatewayError as error:
            yield error.sse()
            return
        finally:
            waiting.cancel()
        if exchange.response.status_code != 200:
            data = await exchange.response.aread()
            await exchange.close()
            yield f"data: {data.decode(errors='replace')}\n\ndata: [DONE]\n\n".encode()
            return
        async for chunk in self.relay(exchange, tenant):
            yield chunk

    async def relay(self, exchange: Exchange, tenant: str | None) -> AsyncIterator[bytes]:
        """The upstream stream, chunk by chunk, from what was read before committing on. Closing it (the
        client went away: Starlette cancels this generator) closes the upstream connection, and the engine
        aborts the request. A replica lost mid-stream ends it with an error event and [DONE], never a
        silent cut."""
        events = count_events(exchange.head)
        try:
            yield exchange.head
            try:
                async for chunk in exchange.rest():
                    events += count_events(chunk)
                    yield chunk
            except (*CONNECTION_LOST, httpx.TimeoutException) as exc:
                reason = "upstream_timeout" if isinstance(exc, httpx.TimeoutException) else "upstream_lost"
                self.metrics.stream_errors.labels(reason).inc()
                pod = exchange.decision.endpoint.pod
                yield GatewayError(502, f"the replica serving this stream ({pod}) was lost after {events} "
                                   "events; the output so far is incomplete", code=reason).sse()  # fmt: skip
        finally:
            await exchange.close()
            self.door.charge_events(tenant, events)

    async def close(self) -> None:
        await self.door.close()
        await self.client.aclose()


def passed_headers(response: httpx.Response) -> dict[str, str]:
    return {name: response.headers[name] for name in PASSED_RESPONSE_HEADERS if name in response.headers}


def build_app(gateway: Gateway) -> Starlette:
    routes = [
        Route(OPENAI_PATH + "/completions", gateway.completions, methods=["POST"]),
        Route(OPENAI_PATH + "/chat/completions", gateway.chat, methods=["POST"]),
        Route(OPENAI_PATH + "/models", gateway.models, methods=["GET"]),
        Route(HEALTH_PATH, gateway.health, methods=["GET"]),
        Route(METRICS_PATH, gateway.metrics_page, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette):
        gateway.loop = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(gateway.fleet.run()), asyncio.ensure_future(gateway.door.stats.run())]
        for companion in gateway.companions:
            await companion.start()
        try:
            yield
        finally:
            for companion in reversed(gateway.companions):
                await companion.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await gateway.close()

    return Starlette(routes=routes, lifespan=lifespan)
