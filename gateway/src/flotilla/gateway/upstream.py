"""Sending a request to a replica: the picker's choice, one retry on another replica when the first fails
before answering (connection refused or reset, or a 503 from an engine that stopped serving), the
in-flight count around the whole exchange, and the headers engines trust only from the gateway."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import httpx

from flotilla.contract import HEADER_INTERNAL_TOKEN, HEADER_TENANT, engine_token
from flotilla.gateway.core.picker import Decision
from flotilla.gateway.core.services import ServiceView
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.metrics import GatewayMetrics
from flotilla.gateway.router import Router

# Failures that happen before the engine answered anything: the request can go elsewhere unharmed.
BEFORE_FIRST_BYTE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                     httpx.WriteError, httpx.PoolTimeout)  # fmt: skip
ATTEMPTS = 2  # the first replica, then one other


def upstream_headers(tenant: str | None, namespace: str, master: str | None) -> dict[str, str]:
    """Only what the engine needs: the body's type and, with the master token, the tenant and the
    namespace's internal token. The client's own headers (its API key, any X-Flotilla-* it sent) stay here."""
    headers = {"content-type": "application/json"}
    if master and tenant:
        headers[HEADER_TENANT] = tenant
        headers[HEADER_INTERNAL_TOKEN] = engine_token(master, namespace)
    return headers


@dataclass
class Exchange:
    """An open upstream response and the replica it came from; `close` ends both (idempotent)."""

    response: httpx.Response
    decision: Decision
    router: Router
    closed: bool = False

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.router.finished(self.decision.endpoint.url)
            await self.response.aclose()


async def send(
    client: httpx.AsyncClient,
    router: Router,
    current: Callable[[], ServiceView | None],
    path: str,
    content: bytes,
    headers: dict[str, str],
    hashes: list[int],
    blocks_per_replica: int | None,
    metrics: GatewayMetrics,
    model_label: str,
) -> Exchange:
    """Opens the upstream response (headers received, body not read). `current` gives the service as it
    is now, so a retry sees the replicas the watches know of by then."""
    exclude: set[str] = set()
    why = "no ready replica"
    for attempt in range(ATTEMPTS):
        service = current()
        decision = router.choose(service, hashes, exclude, blocks_per_replica) if service else None
        if decision is None:
            break
        url = decision.endpoint.url
        router.started(url)
        request = client.build_request("POST", url + path, content=content, headers=headers)
        try:
            response = await client.send(request, stream=True)
        except BEFORE_FIRST_BYTE as exc:
            router.finished(url)
            why = f"{decision.endpoint.pod}: {type(exc).__name__}: {exc}"
        except BaseException:
            router.finished(url)
            raise
        else:
            if response.status_code != 503 or attempt + 1 == ATTEMPTS:
                metrics.decisions.labels(decision.reason).inc()
                return Exchange(response, decision, router)
            why = f"{decision.endpoint.pod}: 503 (not serving)"
            router.finished(url)
            await response.aclose()
        exclude.add(url)
        if attempt + 1 < ATTEMPTS:
            metrics.retries.labels(model_label).inc()
    raise GatewayError(503, f"no replica could take the request ({why}); retry later",
                       code="upstream_unavailable", headers={"Retry-After": "1"})  # fmt: skip
