"""The engine's HTTP server: an OpenAI-compatible API on FastAPI, plus /health, /metrics, /tokenize and
/detokenize.

The model loads in a thread after the server is listening, so /health can say 503 while it loads. The
engine loop runs beside the event loop (AsyncEngine steps in a worker thread). On SIGTERM the server
turns /health to 503, stops accepting connections, lets in-flight requests finish (up to the drain
timeout), and only then stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from flotilla.engine.async_engine import AsyncEngine, EngineDeadError
from flotilla.engine.server import protocol as api
from flotilla.engine.server.errors import ApiError, bad_request, parse_json_body
from flotilla.engine.server.metrics import EngineMetrics
from flotilla.engine.server.openai_serving import Job, Serving

log = logging.getLogger("flotilla.engine.server.app")

DEFAULT_MAX_BODY_BYTES = 8 << 20


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_queue: int | None = 256  # requests accepted but not running; None: unbounded
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


@dataclass
class ServerState:
    settings: ServerSettings
    metrics: EngineMetrics | None = None
    engine: AsyncEngine | None = None
    serving: Serving | None = None
    load_error: BaseException | None = None
    draining: bool = False
    in_flight: int = 0  # engine requests accepted and not yet answered
    created: int = field(default_factory=lambda: int(time.time()))

    def health(self) -> tuple[int, dict[str, Any]]:
        if self.load_error is not None:
            return 503, {"status": "failed", "error": f"loading the model failed: {self.load_error}"}
        if self.engine is None:
            return 503, {"status": "loading"}
        if self.engine.error is not None:
            return 503, {"status": "dead", "error": f"the engine loop stopped: {self.engine.error!r}"}
        if self.draining:
            return 503, {"status": "draining"}
        return 200, {"status": "ok"}


def create_app(
    settings: ServerSettings,
    engine_factory: Callable[[], Any],
    on_load_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """engine_factory builds the LLMEngine (slow: runs in a thread after start-up)."""
    state = ServerState(settings)
    state.metrics = EngineMetrics(settings.model_name, lambda: state.engine.stats() if state.engine else None)

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
        state.serving = Serving(engine, state.metrics, settings.model_name)
        state.engine = engine
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
    _add_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

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


def _doc(model: type[BaseModel]) -> dict:
    """OpenAPI: this route reads a JSON body of `model` (parsed by hand, for OpenAI-shaped errors)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


ERRORS = {code: {"model": api.ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)}


def _add_routes(app: FastAPI, state: ServerState) -> None:
    settings = state.settings

    def check_key(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), settings.api_key):
            message = "missing API key" if not header else "invalid API key"
            raise ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def serving() -> Serving:
        status, body = state.health()
        # Draining still serves: only readiness drops, and the listener closes after --shutdown-delay.
        if status != 200 and body["status"] != "draining":
            raise ApiError(503, f"the engine is not serving: {body.get('error', body['status'])}",
                           code=body["status"], headers={"Retry-After": "1"})  # fmt: skip
        assert state.serving is not None
        return state.serving

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_name:
            raise ApiError(
                404,
                f"the model '{name}' does not exist; this server serves '{settings.model_name}'",
                param="model",
                code="model_not_found",
            )

    def admit(job: Job) -> Callable[[], None]:
        """Counts the job in flight, or refuses it with 429 when the queue is full."""
        n = len(job.choices)
        if settings.max_queue is not None and state.engine is not None:
            waiting = max(0, state.in_flight - state.engine.stats().num_running)
            if waiting + n > settings.max_queue:
                raise ApiError(
                    429,
                    f"the queue is full ({waiting} requests waiting, limit {settings.max_queue}); retry later",
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

    async def respond(request: Request, job: Job, body: Callable[[], Awaitable[dict]], events) -> Response:
        release = admit(job)
        if job.stream:
            return _TrackedStream(events, release, media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        try:
            return JSONResponse(await _until_disconnect(request, body()))
        except EngineDeadError as exc:
            raise ApiError(500, f"the engine failed: {exc}", code="engine_error") from exc
        finally:
            release()

    @app.get("/health", response_model=api.HealthResponse, responses={503: {"model": api.HealthResponse}})
    async def health() -> JSONResponse:
        status, body = state.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=api.ModelList, responses=ERRORS)
    async def models(request: Request) -> JSONResponse:
        check_key(request)
        s = serving()
        card = {"id": settings.model_name, "object": "model", "created": state.created,
                "owned_by": "flotilla", "max_model_len": s.max_model_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def generate(request: Request, request_model, job_of, answer_of, events_of) -> Response:
        """Completions and chat alike: checks, one engine job, then a JSON answer or an SSE stream."""
        arrival = time.time()
        check_key(request)
        req = await parse_json_body(request, request_model, settings.max_body_bytes)
        check_model(req.model)
        s = serving()
        job = job_of(s, req, arrival)
        return await respond(
            request, job, lambda: answer_of(s, job, req.logprobs), events_of(s, job, req.logprobs)
        )

    @app.post("/v1/completions", response_model=api.CompletionResponse, responses=ERRORS,
              openapi_extra=_doc(api.CompletionRequest))  # fmt: skip
    async def completions(request: Request) -> Response:
        return await generate(
            request,
            api.CompletionRequest,
            Serving.completion_job,
            Serving.completion,
            Serving.completion_events,
        )

    @app.post("/v1/chat/completions", response_model=api.ChatCompletionResponse, responses=ERRORS,
              openapi_extra=_doc(api.ChatCompletionRequest))  # fmt: skip
    async def chat_completions(request: Request) -> Response:
        return await generate(
            request, api.ChatCompletionRequest, Serving.chat_job, Serving.chat, Serving.chat_events
        )

    @app.post("/tokenize", response_model=api.TokenizeResponse, responses=ERRORS,
              openapi_extra=_doc(api.TokenizeRequest))  # fmt: skip
    async def tokenize(request: Request) -> JSONResponse:
        check_key(request)
        req = await parse_json_body(request, api.TokenizeRequest, settings.max_body_bytes)
        check_model(req.model)
        s = serving()
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            tokens = s.chat_prompt_ids(req.messages, req.add_generation_prompt)
        else:
            tokens = s.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": s.max_model_len})

    @app.post("/detokenize", response_model=api.DetokenizeResponse, responses=ERRORS,
              openapi_extra=_doc(api.DetokenizeRequest))  # fmt: skip
    async def detokenize(request: Request) -> JSONResponse:
        check_key(request)
        req = await parse_json_body(request, api.DetokenizeRequest, settings.max_body_bytes)
        check_model(req.model)
        s = serving()
        bad = [t for t in req.tokens if t >= s.vocab_size]
        if bad:
            raise bad_request(
                f"token ids {bad[:5]} are outside the vocabulary (size {s.vocab_size})", "tokens"
            )
        return JSONResponse({"prompt": s.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    _register_body_schemas(app)


def _register_body_schemas(app: FastAPI) -> None:
    """Adds the hand-parsed request bodies to the OpenAPI components, so the schema is complete."""
    bodies = (api.CompletionRequest, api.ChatCompletionRequest, api.TokenizeRequest, api.DetokenizeRequest)
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = original()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in bodies:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


class _TrackedStream(StreamingResponse):
    """A streaming response that always releases its queue slot, even when the client left before the
    body started (then the body generator never runs, so its own `finally` cannot)."""

    def __init__(self, content, release: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # aborts the engine requests if it had started


class ClientGone(Exception):
    pass


async def _until_disconnect(request: Request, work: Awaitable):
    """Awaits `work`, cancelling it (and so aborting its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ApiError(499, "the client closed the connection", code="client_closed")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
