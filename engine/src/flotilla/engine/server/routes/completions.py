"""POST /v1/completions: read the body past the gate, hand it to the completion serving object."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from flotilla.engine.server import protocol as api
from flotilla.engine.server.gate import Gate, get_gate, require_api_key
from flotilla.engine.server.openapi import ERRORS, json_body

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/completions", response_model=api.CompletionResponse, responses=ERRORS,
             openapi_extra=json_body(api.CompletionRequest))  # fmt: skip
async def completions(request: Request, gate: Gate = Depends(get_gate)) -> Response:
    body, call = await gate.open(request, api.CompletionRequest)
    return await gate.serving().completion.create_completion(body, call)
