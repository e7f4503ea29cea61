"""The gateway's HTTP app: `/v1/completions`, `/v1/chat/completions` and `/v1/models` for every
InferenceService and LoRA adapter (LoRAAdapter objects: a request's "model" names one like a served model;
it goes to its base service's replicas where the operator has loaded it), `/health` and `/metrics` of its
own.

A request passes, in order and before any upstream call: its size (413), its API key (401), its JSON (400),
its model (404, or 403 for another tenant's), its tenant's rate limits (429), the service's quota (429).
Then it is routed (prefix and load, router.py) and relayed, streamed chunk by chunk; or, when the service
has no ready replica but will get one (scale from zero, a restart), held until one is Ready, with SSE
comment heartbeats to a streaming client. A client that goes away aborts the upstream request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from flotilla import timestamps
from flotilla.contract import HEALTH_PATH, METRICS_PATH, OPENAI_PATH
from flotilla.disconnect import ClientDisconnected, until_disconnected
from flotilla.gateway.config import GatewaySettings
from flotilla.gateway.core.keys import parse_bearer
from flotilla.gateway.core.rate_limit import Limited, RateLimiter
from flotilla.gateway.core.services import ServiceView, routable, scales_from_zero
from flotilla.gateway.engine_stats import EngineStats
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.fleet import Fleet
from flotilla.gateway.hold import HoldQueue, QueueFull, Ready, Refused, TimedOut
from flotilla.gateway.metrics import GatewayMetrics
from flotilla.gateway.prompts import PromptHasher
from flotilla.gateway.router import Router
from flotilla.gateway.upstream import CONNECTION_LOST, Exchange, send, upstream_headers

PASSED_RESPONSE_HEADERS = ("content-type", "retry-after", "x-request-id")
DEMAND_INTERVAL = 5.0  # seconds between two demand signals for one service while requests wait


class Gateway:
    def __init__(self, settings: GatewaySettings, fleet: Fleet, stats: EngineStats | None = None) -> None:
        self.settings, self.fleet = settings, fleet
        self.stats = stats or EngineStats(fleet.endpoint_urls)
        self.metrics = GatewayMetrics()
        self.router = Router(settings.routing, self.stats)
        self.limiter = RateLimiter()
        self.holds = HoldQueue(settings.max_held)
        self.hasher = PromptHasher()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=settings.upstream_timeout, write=30.0, pool=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.demand_sent: dict[str, float] = {}
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop: watches and requests run on it
        fleet.on_change = self.fleet_changed

    # -- the fleet changed: wake held requests whose service can now be served (or never will) --------
    def fleet_changed(self) -> None:
        for key in list(self.holds.held_counts()):
            service = self.fleet.index.get(key)
            if service is None:
                self.holds.fail(key, "the model was deleted while the request waited for it")
            elif routable(service):
                self.holds.release_all(key)
            elif service.quota_refusal:
                self.holds.fail(key, service.quota_refusal)
            elif service.adapter_refusal:
                self.holds.fail(key, service.adapter_refusal)
        keep = {s.key for s in [*self.fleet.index.services(), *self.fleet.index.adapters()]}
        self.router.forget_services(keep)

    # -- the endpoints --------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self.serve(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self.serve(request, chat=True)

    async def models(self, request: Request) -> Response:
        try:
            tenant = self.authenticate(request)
        except GatewayError as error:
            return error.response()
        index = self.fleet.index
        data = []
        for model_id, service in index.visible_models(tenant):
            entry = {"id": model_id, "object": "model", "owned_by": service.tenant or "flotilla"}
            if service.adapter:  # as the engine lists an adapter: `parent` is its base model's id
                entry["parent"] = index.parent_id(service, tenant)
            data.append(entry)
        return JSONResponse({"object": "list", "data": data})

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
        tenant = self.authenticate(request)
        labels["tenant"] = tenant or ""
        content = await self.read_body(request)
        body = parse_body(content)
        service = self.resolve(body, tenant)
        labels["model"] = service.served_name
        if tenant is not None:
            limited = self.limiter.admit(tenant, self.fleet.rate_limits(tenant), time.monotonic())
            if isinstance(limited, Limited):
                self.metrics.rate_limited.labels(tenant, limited.limit).inc()
                raise GatewayError(429, limited.message, code="rate_limit_exceeded",
                                   headers={"Retry-After": str(limited.retry_after_seconds)})  # fmt: skip
        if body["model"] != service.upstream_model:  # `namespace/name`, or an adapter on a shared base
            body["model"] = service.upstream_model
            content = json.dumps(body).encode()
        stream = body.get("stream") is True
        path = OPENAI_PATH + ("/chat/completions" if chat else "/completions")
        if not routable(service):
            self.check_can_wait(service)
            if stream:
                return StreamingResponse(
                    self.held_stream(request, service, tenant, path, content, body, chat),
                    media_type="text/event-stream",
                )
            held_at = time.perf_counter()
            await until_disconnected(self.wait_for_replica(service), request.receive)
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
        self.charge_completion(tenant, data)
        return Response(
            data, status_code=exchange.response.status_code, headers=passed_headers(exchange.response)
        )

    def authenticate(self, request: Request) -> str | None:
        if not self.settings.require_keys:
            return None
        header = request.headers.get("authorization")
        tenant = self.fleet.keys.tenant_of(parse_bearer(header))
        if tenant is None:
            message = (
                "missing API key: send 'Authorization: Bearer <key>'" if not header else "invalid API key"
            )
            raise GatewayError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return tenant

    async def read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(size, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def resolve(self, body: dict[str, Any], tenant: str | None) -> ServiceView:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise GatewayError(400, "'model' is required: a string naming the model to use", code="invalid_model",
                               param="model")  # fmt: skip
        found = self.fleet.index.resolve(model, tenant)
        if isinstance(found, ServiceView):
            return found
        raise GatewayError(found.status, found.message, code=found.code, param="model")

    def check_can_wait(self, service: ServiceView) -> None:
        """A service without a ready replica: refuse at once when none is coming."""
        if service.quota_refusal:
            raise GatewayError(429, f"the model {service.served_name!r} cannot get a replica: {service.quota_refusal}",
                               code="insufficient_quota")  # fmt: skip
        if service.adapter_refusal:
            raise GatewayError(503, f"the adapter {service.served_name!r} cannot be served: {service.adapter_refusal}",
                               code="adapter_unavailable", headers={"Retry-After": "10"})  # fmt: skip
        if not scales_from_zero(service) and service.desired_replicas == 0:
            what = (
                f"the adapter {service.served_name!r}'s base service"
                if service.adapter
                else f"the model {service.served_name!r}"
            )
            raise GatewayError(503, f"{what} has no replicas (it is scaled to 0)",
                               code="no_replicas", headers={"Retry-After": "30"})  # fmt: skip

    async def wait_for_replica(self, service: ServiceView) -> None:
        """Holds the request until the service has a ready replica; signals demand meanwhile."""
        demand = asyncio.ensure_future(self.signal_demand(service))
        try:
            outcome = await self.holds.hold(service.key, self.settings.hold_timeout)
        finally:
            demand.cancel()
        if isinstance(outcome, Ready):
            return
        if isinstance(outcome, QueueFull):
            raise GatewayError(429, f"{outcome.max_held} requests already wait for a replica of "
                               f"{service.served_name!r}; retry later", code="hold_queue_full",
                               headers={"Retry-After": "5"})  # fmt: skip
        if isinstance(outcome, Refused):
            if service.adapter:
                raise GatewayError(503, f"the adapter {service.served_name!r} cannot be served: {outcome.message}",
                                   code="adapter_unavailable", headers={"Retry-After": "10"})  # fmt: skip
            raise GatewayError(429, f"the model {service.served_name!r} cannot get a replica: {outcome.message}",
                               code="insufficient_quota")  # fmt: skip
        assert isinstance(outcome, TimedOut)
        if service.adapter:
            raise GatewayError(503, f"no replica of {service.served_name!r}'s base service had the adapter loaded "
                               f"within {outcome.waited_seconds:g}s; retry later", code="no_replica_ready",
                               headers={"Retry-After": "10"})  # fmt: skip
        raise GatewayError(503, f"no replica of {service.served_name!r} became ready within "
                           f"{outcome.waited_seconds:g}s; retry later", code="no_replica_ready",
                           headers={"Retry-After": "10"})  # fmt: skip

    async def signal_demand(self, service: ServiceView) -> None:
        """While requests wait for a service, tell the operator (every DEMAND_INTERVAL seconds)."""
        while True:
            current = self.fleet.index.get(service.key) or service
            last = self.demand_sent.get(service.key, -DEMAND_INTERVAL)
            # Also while a replica comes up: a model that loads for longer than the idle period must
            # not be scaled back to zero under the requests waiting for it.
            if time.monotonic() - last >= DEMAND_INTERVAL:
                self.demand_sent[service.key] = time.monotonic()
                await self.fleet.demand(current, timestamps.now(micro=True))
            await asyncio.sleep(1.0)

    async def open(
        self, service: ServiceView, tenant: str | None, path: str, content: bytes, body: dict, chat: bool,
        arrival: float,
    ) -> Exchange:  # fmt: skip
        """Tokenize and hash the prompt, route, send; the prompt's tokens are charged to the tenant."""
        endpoints = [e.url for e in routable(service)]
        key = service.key
        # An adapter's prompts use its base's tokenizer, and chain their blocks from the adapter's root.
        prompt_tokens, hashes = await self.hasher.hashes(
            service.base_key, endpoints, chat, body, service.adapter
        )
        known = self.hasher.known(service.base_key)
        if tenant is not None and prompt_tokens:
            self.limiter.charge_tokens(tenant, prompt_tokens, time.monotonic())
        headers = upstream_headers(tenant, service.namespace, self.settings.engine_token_master)
        sent = time.perf_counter()
        self.metrics.added_latency.observe(sent - arrival)
        exchange = await send(self.client, self.router, lambda: self.fleet.index.get(key), path, content, headers,
                              hashes, known.num_blocks if known else None, self.metrics,
                              service.served_name, body.get("stream") is True,
                              retry_not_found=service.adapter is not None)  # fmt: skip
        self.metrics.upstream_ttfb.labels(service.served_name).observe(time.perf_counter() - sent)
        if prompt_tokens:
            block = known.block_size if known else 1
            self.metrics.prompt_tokens.inc(prompt_tokens)
            self.metrics.predicted_hit_tokens.inc(min(prompt_tokens, exchange.decision.hit_blocks * block))
        return exchange

    async def held_stream(
        self, request: Request, service: ServiceView, tenant: str | None, path: str, content: bytes, body: dict,
        chat: bool,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """A streaming request held for a replica: heartbeats while it waits, then the upstream stream; an
        error after the 200 went out is one SSE error event."""
        held_at = time.perf_counter()
        waiting = asyncio.ensure_future(self.wait_for_replica(service))
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
        events = exchange.head.count(b"data: {")
        try:
            yield exchange.head
            try:
                async for chunk in exchange.rest():
                    events += chunk.count(b"data: {")
                    yield chunk
            except (*CONNECTION_LOST, httpx.TimeoutException) as exc:
                reason = "upstream_timeout" if isinstance(exc, httpx.TimeoutException) else "upstream_lost"
                self.metrics.stream_errors.labels(reason).inc()
                pod = exchange.decision.endpoint.pod
                yield GatewayError(502, f"the replica serving this stream ({pod}) was lost after {events} "
                                   "events; the output so far is incomplete", code=reason).sse()  # fmt: skip
        finally:
            await exchange.close()
            if tenant is not None and events:
                self.limiter.charge_tokens(tenant, events, time.monotonic())  # about one token per event

    def charge_completion(self, tenant: str | None, data: bytes) -> None:
        if tenant is None:
            return
        with contextlib.suppress(ValueError, LookupError, TypeError):  # an error body has no usage
            completion = int(json.loads(data)["usage"]["completion_tokens"])
            self.limiter.charge_tokens(tenant, completion, time.monotonic())

    async def close(self) -> None:
        self.holds.fail_everything("the gateway is shutting down")
        await self.client.aclose()
        await self.hasher.close()
        await self.stats.close()


def parse_body(content: bytes) -> dict[str, Any]:
    try:
        body = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise GatewayError(
            400, f"the body must be a JSON object, not {type(body).__name__}", code="invalid_json"
        )
    return body


def too_large(size: int, limit: int) -> GatewayError:
    return GatewayError(413, f"the request body ({size} bytes or more) is over the gateway's limit of {limit} bytes",
                        code="request_too_large")  # fmt: skip


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
        tasks = [asyncio.ensure_future(gateway.fleet.run()), asyncio.ensure_future(gateway.stats.run())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await gateway.close()

    return Starlette(routes=routes, lifespan=lifespan)
