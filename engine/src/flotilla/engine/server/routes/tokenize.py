"""POST /tokenize and /detokenize: the server's tokenizer, for clients that count or build prompts; and
GET ENGINE_TOKENIZER_PATH: the tokenizer's files and the KV block size, for the gateway, which tokenizes and
hashes prompts exactly as this engine does (flotilla.tokenizer, flotilla.contract.prefix_block_hashes)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from flotilla.contract import ENGINE_TOKENIZER_PATH
from flotilla.engine.server import protocol as api
from flotilla.engine.server.errors import bad_request, parse_json_body
from flotilla.engine.server.gate import Gate, get_gate, require_api_key
from flotilla.engine.server.openapi import ERRORS, json_body

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/tokenize", response_model=api.TokenizeResponse, responses=ERRORS,
             openapi_extra=json_body(api.TokenizeRequest))  # fmt: skip
async def tokenize(request: Request, gate: Gate = Depends(get_gate)) -> JSONResponse:
    req = await parse_json_body(request, api.TokenizeRequest, gate.settings.max_body_bytes)
    gate.check_model(req.model)
    serving = gate.serving()
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
    if req.messages is not None:
        tokens = serving.chat.prompt_ids(req.messages, req.add_generation_prompt)
    else:
        tokens = serving.engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    max_model_len = serving.engine.resolved.max_model_len
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len})


@router.post("/detokenize", response_model=api.DetokenizeResponse, responses=ERRORS,
             openapi_extra=json_body(api.DetokenizeRequest))  # fmt: skip
async def detokenize(request: Request, gate: Gate = Depends(get_gate)) -> JSONResponse:
    req = await parse_json_body(request, api.DetokenizeRequest, gate.settings.max_body_bytes)
    gate.check_model(req.model)
    engine = gate.serving().engine
    vocab_size = engine.resolved.vocab_size
    bad = [t for t in req.tokens if t >= vocab_size]
    if bad:
        raise bad_request(f"token ids {bad[:5]} are outside the vocabulary (size {vocab_size})", "tokens")
    return JSONResponse({"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)})


@router.get(ENGINE_TOKENIZER_PATH, responses=ERRORS, include_in_schema=False)
async def tokenizer_files(gate: Gate = Depends(get_gate)) -> JSONResponse:
    engine = gate.serving().engine
    resolved, tokenizer = engine.resolved, engine.tokenizer
    return JSONResponse({
        "model": gate.settings.model_name,
        "block_size": resolved.block_size,
        "prefix_caching": resolved.prefix_caching,
        "num_blocks": resolved.num_blocks,
        "tokenizer_json": tokenizer.tokenizer.to_str(),
        "tokenizer_config": tokenizer.config,
    })  # fmt: skip
