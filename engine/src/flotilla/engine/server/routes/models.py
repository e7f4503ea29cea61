"""GET /v1/models: the base model this server serves, and each LoRA adapter loaded over it."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from flotilla.engine.server import protocol as api
from flotilla.engine.server.gate import Gate, get_gate, require_api_key
from flotilla.engine.server.openapi import ERRORS

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/models", response_model=api.ModelList, responses=ERRORS)
async def models(gate: Gate = Depends(get_gate)) -> JSONResponse:
    resolved = gate.serving().engine.resolved
    info = resolved.model_info
    base = gate.settings.model_name
    card = {"id": base, "object": "model", "created": gate.state.created, "owned_by": "flotilla",
            "root": base, "parent": None, "max_model_len": resolved.max_model_len,
            "quantization": info.quantization, "quantization_group_size": info.quantization_group_size,
            "weight_bytes": info.weight_bytes}  # fmt: skip
    engine = gate.serving().engine
    # Each loaded LoRA adapter is a model of its own whose parent is the base (vLLM's listing).
    adapters = [card | {"id": name, "root": path, "parent": base} for name, path in engine.lora_adapters()]
    return JSONResponse({"object": "list", "data": [card, *adapters]})
