"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from flotilla.engine.server import protocol as api
from flotilla.engine.server.gate import Gate, get_gate, require_api_key
from flotilla.engine.server.openai_serving import Serving
from flotilla.engine.server.openapi import ERRORS, json_body
from flotilla.engine.server.routes.generation import serve_generation

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions", response_model=api.ChatCompletionResponse, responses=ERRORS,
             openapi_extra=json_body(api.ChatCompletionRequest))  # fmt: skip
async def chat_completions(request: Request, gate: Gate = Depends(get_gate)) -> Response:
    return await serve_generation(
        request, gate, api.ChatCompletionRequest, Serving.chat_job, Serving.chat, Serving.chat_events
    )
