"""OpenAPI for the hand-parsed JSON bodies: the API routes read their bodies themselves (so errors
keep OpenAI's shape), so FastAPI cannot see them; these helpers put them back in the schema."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel

from flotilla.engine.server import protocol as api

ERRORS = {code: {"model": api.ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)}
# The LoRA routes also answer 403 (no internal token) and 409 (an adapter in use).
LORA_ERRORS = ERRORS | {code: {"model": api.ErrorResponse} for code in (403, 409)}
BODIES = (api.CompletionRequest, api.ChatCompletionRequest, api.TokenizeRequest, api.DetokenizeRequest,
          api.LoadLoRAAdapterRequest, api.UnloadLoRAAdapterRequest)  # fmt: skip


def json_body(model: type[BaseModel]) -> dict:
    """openapi_extra for a route that reads a JSON body of `model`."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def register_body_schemas(app: FastAPI) -> None:
    """Adds the hand-parsed request bodies to the OpenAPI components, so the schema is complete."""
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = original()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in BODIES:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
