"""What completions and chat share: read and check the body, build one engine job, then answer it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from pydantic import BaseModel

from flotilla.engine.server.errors import parse_json_body
from flotilla.engine.server.gate import Gate
from flotilla.engine.server.openai_serving import Job, Serving
from flotilla.engine.server.respond import respond


async def serve_generation(
    request: Request,
    gate: Gate,
    request_model: type[BaseModel],
    job_of: Callable[[Serving, BaseModel, float, str], Job],
    answer_of: Callable[[Serving, Job, object], Awaitable[dict]],
    events_of: Callable[[Serving, Job, object], AsyncIterator[str]],
) -> Response:
    """A JSON answer or an SSE stream, after the tenant, model and queue checks (the key was checked
    already). Every check raises before the job is admitted, so a refused request holds nothing."""
    arrival = time.time()  # TTFT counts from here
    tenant = gate.tenant(request)  # before the body is read: a forbidden request costs no parsing
    # Both request models carry `model` and `logprobs`; pyright sees only their BaseModel.
    req: Any = await parse_json_body(request, request_model, gate.settings.max_body_bytes)
    gate.check_model(req.model)
    s = gate.serving()
    job = job_of(s, req, arrival, tenant)
    return await respond(
        request, gate, job, lambda: answer_of(s, job, req.logprobs), events_of(s, job, req.logprobs)
    )
