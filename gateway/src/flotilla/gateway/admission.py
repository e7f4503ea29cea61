"""The front door's rules, written once: what both data paths, the HTTP relay (app.py) and the ext_proc
endpoint picker behind Envoy (extproc/), decide about a request before any upstream byte moves.

In order: its API key (401) and its declared size (413), then its body's size (413) and JSON (400), its
model (404, for another tenant's too: a key learns nothing of other tenants' names), its tenant's rate limits (429 with
Retry-After); then, for a service without a ready replica, whether one is coming (429 quota, 503) and the
hold until it is Ready (waking the autoscaler meanwhile); then the prompt's tokens and block hashes for
the prefix-aware pick (router.py), and the tenant's token charges, prompt and completion.

Every refusal is a GatewayError (OpenAI's shape); each data path only turns it into its own answer: a
Starlette response or SSE event (app.py), an ext_proc ImmediateResponse (extproc/responses.py). The
state the rules keep (rate-limit buckets, held requests, in-flight counts, the prefix tables) lives in one
FrontDoor, so a process serving both paths applies one budget per tenant across them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flotilla import timestamps
from flotilla.contract import OPENAI_PATH
from flotilla.gateway.config import GatewaySettings
from flotilla.gateway.core.keys import parse_bearer
from flotilla.gateway.core.picker import Decision
from flotilla.gateway.core.rate_limit import Limited, LimitKind
from flotilla.gateway.core.services import ServiceView, routable, scales_from_zero
from flotilla.gateway.engine_stats import EngineStats
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.fleet import Fleet
from flotilla.gateway.hold import HoldQueue, QueueFull, Ready, Refused, TimedOut
from flotilla.gateway.metrics import GatewayMetrics
from flotilla.gateway.prompts import PromptHasher
from flotilla.gateway.router import Router
from flotilla.gateway.tenant_limits import tenant_limits

DEMAND_INTERVAL = 5.0  # seconds between two demand signals for one service while requests wait
COMPLETIONS, CHAT_COMPLETIONS = OPENAI_PATH + "/completions", OPENAI_PATH + "/chat/completions"


@dataclass
class Admitted:
    """A request that passed the checks before routing: who sent it, for which service, and the body as
    the engine gets it (the model named by its served name)."""

    tenant: str | None
    service: ServiceView
    body: dict[str, Any]
    content: bytes
    chat: bool

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    @property
    def path(self) -> str:
        return CHAT_COMPLETIONS if self.chat else COMPLETIONS


@dataclass(frozen=True)
class Prompt:
    """The prompt as the router sees it: its token count and the chained hashes of its full blocks."""

    tokens: int
    hashes: list[int]
    blocks_per_replica: int | None  # one replica's KV blocks, once the service's tokenizer is known
    block_size: int


class FrontDoor:
    """The rules and the state they keep, shared by the relay and the picker of one gateway process."""

    def __init__(self, settings: GatewaySettings, fleet: Fleet, stats: EngineStats | None = None) -> None:
        self.settings, self.fleet = settings, fleet
        self.stats = stats or EngineStats(fleet.endpoint_urls)
        self.metrics = GatewayMetrics()
        self.router = Router(settings.routing, self.stats)
        # The tenants' rate-limit buckets: this replica's, or every replica's in Redis (tenant_limits.py).
        self.limits = tenant_limits(settings.rate_limit_store, self.metrics.rate_limit_store_errors.inc)
        self.holds = HoldQueue(settings.max_held)
        self.hasher = PromptHasher()
        self.demand_sent: dict[str, float] = {}
        self.fleet_listeners: list[Callable[[], None]] = []  # run after each change (the picker's EDS)
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
        self.metrics.known(
            sorted({s.served_name for s in self.fleet.index.services()}), self.limited_tenants()
        )
        for listener in self.fleet_listeners:
            listener()

    def limited_tenants(self) -> dict[str, list[LimitKind]]:
        """Each tenant with a rate limit, and which limits it has."""
        return {tenant: kinds for tenant, limits in self.fleet.limits.items() if (kinds := limits.kinds())}

    # -- before the body ------------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant of the `Authorization` header's key (None when keys are off), else 401."""
        if not self.settings.require_keys:
            return None
        tenant = self.fleet.keys.tenant_of(parse_bearer(authorization))
        if tenant is None:
            message = (
                "missing API key: send 'Authorization: Bearer <key>'"
                if not authorization
                else "invalid API key"
            )
            raise GatewayError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return tenant

    def check_declared_size(self, content_length: str | None) -> None:
        if content_length and content_length.isdigit():
            self.check_size(int(content_length))

    def check_size(self, size: int) -> None:
        limit = self.settings.max_body_bytes
        if size > limit:
            raise GatewayError(413, f"the request body ({size} bytes or more) is over the gateway's limit of "
                               f"{limit} bytes", code="request_too_large")  # fmt: skip

    def model_list(self, tenant: str | None) -> dict[str, Any]:
        """`/v1/models`: the models the tenant may use, as OpenAI lists them."""
        index = self.fleet.index
        data = []
        for model_id, service in index.visible_models(tenant):
            entry = {"id": model_id, "object": "model", "owned_by": service.tenant or "flotilla"}
            if service.adapter:  # as the engine lists an adapter: `parent` is its base model's id
                entry["parent"] = index.parent_id(service, tenant)
            data.append(entry)
        return {"object": "list", "data": data}

    # -- the body -------------------------------------------------------------------------------------
    async def admit(self, tenant: str | None, content: bytes, chat: bool) -> Admitted:
        """The body's checks (400, 404), then the tenant's rate limits (429)."""
        admitted = self.check(tenant, content, chat)
        if tenant is not None:
            limited = await self.limits.admit(tenant, self.fleet.rate_limits(tenant))
            if isinstance(limited, Limited):
                self.metrics.rate_limited.labels(tenant, limited.limit).inc()
                raise GatewayError(429, limited.message, code="rate_limit_exceeded",
                                   headers={"Retry-After": str(limited.retry_after_seconds)})  # fmt: skip
        return admitted

    def check(self, tenant: str | None, content: bytes, chat: bool) -> Admitted:
        """The body's checks alone (400, 404): what the request is, before any limit is spent on it."""
        body = parse_body(content)
        service = self.resolve(body, tenant)
        if body["model"] != service.upstream_model:  # `namespace/name`, or an adapter on a shared base
            body["model"] = service.upstream_model
            content = json.dumps(body).encode()
        return Admitted(tenant, service, body, content, chat)

    def resolve(self, body: dict[str, Any], tenant: str | None) -> ServiceView:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise GatewayError(400, "'model' is required: a string naming the model to use", code="invalid_model",
                               param="model")  # fmt: skip
        found = self.fleet.index.resolve(model, tenant)
        if isinstance(found, ServiceView):
            return found
        raise GatewayError(found.status, found.message, code=found.code, param="model")

    # -- no ready replica: refuse, or hold -------------------------------------------------------------
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
            last = self.demand_sent.get(service.key)
            # Also while a replica comes up: a model that loads for longer than the idle period must
            # not be scaled back to zero under the requests waiting for it.
            if last is None or time.monotonic() - last >= DEMAND_INTERVAL:
                self.demand_sent[service.key] = time.monotonic()
                await self.fleet.demand(current, timestamps.now(micro=True))
            await asyncio.sleep(1.0)

    # -- routing and charges ---------------------------------------------------------------------------
    async def prompt(self, admitted: Admitted) -> Prompt:
        """Tokenizes and hashes the prompt for the router; its tokens are charged to the tenant."""
        service = admitted.service
        endpoints = [e.url for e in routable(service)]
        # An adapter's prompts use its base's tokenizer, and chain their blocks from the adapter's root.
        tokens, hashes = await self.hasher.hashes(
            service.base_key, endpoints, admitted.chat, admitted.body, service.adapter
        )
        known = self.hasher.known(service.base_key)
        if admitted.tenant is not None and tokens:
            self.charge(admitted.tenant, tokens)
        return Prompt(tokens, hashes, known.num_blocks if known else None, known.block_size if known else 1)

    def count_prompt(self, prompt: Prompt, decision: Decision) -> None:
        """The prompt's tokens and those the chosen replica is predicted to hold (the routing decision itself
        is counted by whoever makes the last one: the relay after its retries, the picker)."""
        if prompt.tokens:
            self.metrics.prompt_tokens.inc(prompt.tokens)
            hit = min(prompt.tokens, decision.hit_blocks * prompt.block_size)
            self.metrics.predicted_hit_tokens.inc(hit)

    def charge_completion(self, tenant: str | None, data: bytes) -> None:
        """A whole (not streamed) response's completion tokens, from its usage."""
        if tenant is None:
            return
        with contextlib.suppress(ValueError, LookupError, TypeError):  # an error body has no usage
            completion = int(json.loads(data)["usage"]["completion_tokens"])
            self.charge(tenant, completion)

    def charge_events(self, tenant: str | None, events: int) -> None:
        """A streamed response's completion, about one token per event."""
        if tenant is not None and events:
            self.charge(tenant, events)

    def charge(self, tenant: str, tokens: int) -> None:
        """Tokens taken from the tenant's token bucket (without waiting for a shared store)."""
        self.limits.charge(tenant, self.fleet.rate_limits(tenant), tokens)

    async def close(self) -> None:
        self.holds.fail_everything("the gateway is shutting down")
        await self.hasher.close()
        await self.stats.close()
        await self.limits.close()


def count_events(chunk: bytes) -> int:
    """The completion events in a chunk of an engine's stream (each carries about one token)."""
    return chunk.count(b"data: {")


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
