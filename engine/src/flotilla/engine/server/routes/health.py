"""GET /health (readiness: 503 while loading, failed, dead or draining) and GET /metrics (Prometheus).
Neither asks for the API key: probes and scrapers do not carry one."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from flotilla.contract import HEALTH_PATH, METRICS_PATH
from flotilla.engine.server import protocol as api
from flotilla.engine.server.gate import server_state
from flotilla.engine.server.state import ServerState

router = APIRouter()


@router.get(HEALTH_PATH, response_model=api.HealthResponse, responses={503: {"model": api.HealthResponse}})
async def health(state: ServerState = Depends(server_state)) -> JSONResponse:
    status, body = state.health()
    return JSONResponse(body, status_code=status)


@router.get(METRICS_PATH, response_class=Response)
async def metrics(state: ServerState = Depends(server_state)) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
