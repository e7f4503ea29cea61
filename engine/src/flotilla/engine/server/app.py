"""The engine's HTTP server: an OpenAI-compatible API on FastAPI, plus /health, /metrics, /tokenize and
/detokenize.

This module only builds the app: its state, the lifespan that loads the model and stops the engine,
the error handlers, and the routers (routes/, one per endpoint group, each a thin parse-and-call: the
checks before the body are gate.py's, generation is serving_completion.py's and serving_chat.py's).

The model loads in a thread after the server is listening, so /health can say 503 while it loads. The
engine loop runs beside the event loop (AsyncEngine steps in a worker thread). On SIGTERM the server
turns /health to 503, stops accepting connections, lets in-flight requests finish (up to the drain
timeout), and only then stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flotilla.engine.async_engine import AsyncEngine
from flotilla.engine.lora.errors import LoRAError, LoRAInUse, UnknownLoRA
from flotilla.engine.server.errors import ApiError, bad_request, lora_error
from flotilla.engine.server.metrics import EngineMetrics
from flotilla.engine.server.openapi import register_body_schemas
from flotilla.engine.server.routes import chat, completions, health, lora, models, tokenize
from flotilla.engine.server.state import DEFAULT_MAX_BODY_BYTES, ServerSettings, ServerState, Serving

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DrainingServer", "ServerSettings", "ServerState", "create_app"]

log = logging.getLogger("flotilla.engine.server.app")

ROUTERS = (health.router, models.router, completions.router, chat.router, tokenize.router, lora.router)


def create_app(
    settings: ServerSettings,
    engine_factory: Callable[[], Any],
    on_load_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """engine_factory builds the LLMEngine (slow: runs in a thread after start-up)."""
    state = ServerState(settings)
    state.metrics = EngineMetrics(
        settings.model_name,
        lambda: state.engine.stats() if state.engine else None,
        max_tenant_labels=settings.max_tenant_labels,
        model_info=lambda: state.engine.resolved.model_info if state.engine else None,
    )

    async def load() -> None:
        try:
            llm = await asyncio.to_thread(engine_factory)
        except Exception as exc:
            log.exception("loading the model failed")
            state.load_error = exc
            if on_load_failure is not None:
                on_load_failure(exc)
            return
        engine = AsyncEngine(llm)
        engine.start()
        state.serving = Serving.over(engine, state.metrics, settings.model_name)
        log.info("model %s loaded; serving", settings.model_name)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        loader = asyncio.create_task(load(), name="flotilla-load")
        yield
        # Connections have drained by now (uvicorn waits for them before the lifespan ends).
        loader.cancel()
        with contextlib.suppress(BaseException):
            await loader
        if state.engine is not None:
            with contextlib.suppress(Exception):  # a dead loop re-raises its error here
                await state.engine.shutdown()

    app = FastAPI(title="Flotilla engine", version="v1", lifespan=lifespan)
    app.state.flotilla = state
    _add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    register_body_schemas(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(LoRAError)
    @app.exception_handler(UnknownLoRA)
    @app.exception_handler(LoRAInUse)
    async def adapter_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, LoRAError | UnknownLoRA | LoRAInUse)
        return lora_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return bad_request(str(exc)).response()

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return ApiError(500, f"internal error: {exc!r}", code="internal_error").response()


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: /health answers 503 at once, new requests are still served for
    `shutdown_delay` seconds (so endpoints and load balancers stop routing here first, as a preStop sleep
    would), then uvicorn stops listening and waits (up to timeout_graceful_shutdown) for in-flight ones.
    A second signal skips the delay."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_delay: float = 0.0) -> None:
        super().__init__(config)
        self.flotilla_state = state
        self.shutdown_delay = shutdown_delay

    def handle_exit(self, sig, frame) -> None:
        if self.flotilla_state.draining or self.shutdown_delay <= 0:
            self.flotilla_state.draining = True
            super().handle_exit(sig, frame)
            return
        self.flotilla_state.draining = True
        log.info(
            "draining: /health is 503; serving new requests %.0fs more, then finishing %d in flight",
            self.shutdown_delay,
            self.flotilla_state.in_flight,
        )
        timer = threading.Timer(self.shutdown_delay, super().handle_exit, (sig, frame))
        timer.daemon = True
        timer.start()
