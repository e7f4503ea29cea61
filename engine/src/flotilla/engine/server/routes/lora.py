"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime adapter API, so that clients
and controllers written for vLLM work unchanged. Both answer in plain text on success, as vLLM does;
refusals are OpenAI-shaped errors (errors.lora_error): 400 naming the field for a bad adapter or name,
404 for an adapter that is not loaded, 409 for one that unfinished requests still use. An engine with an
internal token (every engine the operator runs) answers both only to callers that send it (403)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from flotilla.contract import FLAG_ENABLE_LORA
from flotilla.engine.lora.errors import LoRAError
from flotilla.engine.server import protocol as api
from flotilla.engine.server.errors import parse_json_body
from flotilla.engine.server.gate import Gate, get_gate, require_api_key
from flotilla.engine.server.openapi import LORA_ERRORS, json_body
from flotilla.engine.server.tenancy import require_internal_token

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/load_lora_adapter", responses=LORA_ERRORS, response_class=PlainTextResponse,
             openapi_extra=json_body(api.LoadLoRAAdapterRequest))  # fmt: skip
async def load_lora_adapter(request: Request, gate: Gate = Depends(get_gate)) -> PlainTextResponse:
    require_internal_token(request.headers, gate.settings.internal_token, "loading a LoRA adapter")
    body = await parse_json_body(request, api.LoadLoRAAdapterRequest, gate.settings.max_body_bytes)
    engine = gate.serving().engine
    if not engine.lora_enabled:
        raise LoRAError(
            f"this server serves no LoRA adapters (start it with {FLAG_ENABLE_LORA})", "lora_name"
        )
    if body.lora_name == gate.settings.model_name:
        raise LoRAError(f"lora_name {body.lora_name!r} is the base model's name", "lora_name")
    await engine.load_lora(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=LORA_ERRORS, response_class=PlainTextResponse,
             openapi_extra=json_body(api.UnloadLoRAAdapterRequest))  # fmt: skip
async def unload_lora_adapter(request: Request, gate: Gate = Depends(get_gate)) -> PlainTextResponse:
    require_internal_token(request.headers, gate.settings.internal_token, "unloading a LoRA adapter")
    body = await parse_json_body(request, api.UnloadLoRAAdapterRequest, gate.settings.max_body_bytes)
    await gate.serving().engine.unload_lora(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
