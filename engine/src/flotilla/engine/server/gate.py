"""What every API request passes before the engine sees it: the API key, the tenant it names (only with
the internal token; tenancy.py), the model name, an engine that is serving, and a place in the queue (or
429 when it is full).

Handlers get these through FastAPI dependencies; the state lives on `app.state.flotilla`. The
dependencies are `async def` so FastAPI calls them on the event loop, not in a thread pool. A generation
route reads its body through `Gate.open` and hands the `Call` it returns to its serving object, which
admits it to the queue once the request has passed its own checks.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

from flotilla.engine.server.errors import ApiError, parse_json_body
from flotilla.engine.server.protocol import _SamplingFields
from flotilla.engine.server.serving import Call
from flotilla.engine.server.state import ServerSettings, ServerState, Serving
from flotilla.engine.server.tenancy import request_tenant

G = TypeVar("G", bound=_SamplingFields)


async def server_state(request: Request) -> ServerState:
    return request.app.state.flotilla


async def require_api_key(request: Request) -> None:
    """Router dependency: 401 unless the request carries the server's key (when it has one)."""
    api_key = request.app.state.flotilla.settings.api_key
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), api_key):
        message = "missing API key" if not header else "invalid API key"
        raise ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class Gate:
    """The checks a handler makes once it has read the body (they need the body's model name)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    @property
    def settings(self) -> ServerSettings:
        return self.state.settings

    def tenant(self, request: Request) -> str:
        """The request's tenant (403/400 when it names one it may not or cannot be)."""
        return request_tenant(request.headers, self.settings.tenant, self.settings.gateway_token_sha256)

    async def open(self, request: Request, model: type[G]) -> tuple[G, Call]:
        """A generation request's body, once its tenant and model pass (the key was checked already),
        and the call that carries it to its serving object. Every check raises before anything is
        admitted, so a refused request holds nothing."""
        arrival = time.time()  # TTFT counts from here
        tenant = self.tenant(request)  # before the body is read: a forbidden request costs no parsing
        body = await parse_json_body(request, model, self.settings.max_body_bytes)
        lora_name = self.check_model(body.model)
        return body, Call(request, arrival, tenant, self.admit, lora_name)

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's model names (None: the base model), or 404 when it names
        neither."""
        model_name = self.settings.model_name
        if name is None or name == model_name:
            return None
        engine = self.state.engine
        adapters = engine.lora_names() if engine is not None else []
        if name in adapters:
            return name
        served = ", ".join(f"'{n}'" for n in [model_name, *adapters])
        raise ApiError(
            404,
            f"the model '{name}' does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )

    def serving(self) -> Serving:
        status, body = self.state.health()
        # Draining still serves: only readiness drops, and the listener closes after --shutdown-delay.
        if status != 200 and body["status"] != "draining":
            raise ApiError(503, f"the engine is not serving: {body.get('error', body['status'])}",
                           code=body["status"], headers={"Retry-After": "1"})  # fmt: skip
        assert self.state.serving is not None
        return self.state.serving

    def admit(self, n: int) -> Callable[[], None]:
        """Counts n engine requests in flight, or refuses them with 429 when the queue is full. Returns
        the release (safe to call more than once)."""
        state, max_queue = self.state, self.settings.max_queue
        if max_queue is not None and state.engine is not None:
            waiting = max(0, state.in_flight - state.engine.stats().num_running)
            if waiting + n > max_queue:
                raise ApiError(
                    429,
                    f"the queue is full ({waiting} requests waiting, limit {max_queue}); retry later",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
        state.in_flight += n
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                state.in_flight -= n

        return release


async def get_gate(request: Request) -> Gate:
    return Gate(request.app.state.flotilla)
