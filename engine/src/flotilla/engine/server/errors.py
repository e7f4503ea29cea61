"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}} (built by
flotilla.openai_errors, as the gateway's are), and the strict reading of JSON request bodies that produces
them: size limit (413), UTF-8 (400), JSON syntax (400) and the pydantic schema (400, naming the field)."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from flotilla.engine.lora.errors import LoRAError, LoRAInUse, UnknownLoRA
from flotilla.openai_errors import OpenAIError

T = TypeVar("T", bound=BaseModel)


class ApiError(OpenAIError):
    """A refusal of the engine's own (flotilla.openai_errors builds the body, as the gateway's)."""

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing more than `limit` bytes without reading them all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes; the limit is {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_json_body(request: Request, model: type[T], limit: int) -> T:
    raw = await read_body(request, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from exc


def _validation_error(exc: ValidationError) -> ApiError:
    errors = exc.errors(include_url=False)
    # Unions report one error per member; the member-specific locations name types, not fields.
    first = errors[0]
    param = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p)) or None
    message = first["msg"]
    if first["type"] == "missing":
        message = f"'{param}' is a required field"
    elif param:
        message = f"invalid value for '{param}': {message}"
    if len(errors) > 1 and first["type"] != "missing":
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return bad_request(message, param=param)


def _is_type_tag(part) -> bool:
    # pydantic names union members in the location, e.g. ('prompt', 'str') or ('prompt', 'list[int]').
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def lora_error(exc: LoRAError | UnknownLoRA | LoRAInUse) -> ApiError:
    """An adapter refused (400, naming the field), not loaded (404, as an unknown model) or in use (409)."""
    if isinstance(exc, UnknownLoRA):
        return ApiError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, LoRAInUse):
        return ApiError(409, str(exc), param="lora_name", code="lora_in_use")
    return bad_request(str(exc), param=exc.field, code="invalid_lora_adapter")
