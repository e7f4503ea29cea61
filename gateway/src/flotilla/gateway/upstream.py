"""Sending a request to a replica: the picker's choice, the in-flight count around the whole exchange,
the headers engines trust only from the gateway, and one retry on another replica for a request that has
not produced output yet.

The response is committed to the client only once the replica has produced output: a streamed response
once an event carries a token (or a finish, usage, an error, the end), a whole response once its body is
complete. Until then a replica that refuses the connection, resets it, dies, or answers 503 costs the
client nothing, and the request goes once to another replica (completions are idempotent until their
first token, so no request needs to be kept from a retry). After that, a replica lost mid-stream ends the
client's stream with an OpenAI-shaped error event and `[DONE]` (app.py), counted by reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

from flotilla.contract import HEADER_GATEWAY_TOKEN, HEADER_TENANT, gateway_token
from flotilla.gateway.core.picker import Decision
from flotilla.gateway.core.services import ServiceView
from flotilla.gateway.core.sse import has_output
from flotilla.gateway.errors import GatewayError
from flotilla.gateway.metrics import GatewayMetrics
from flotilla.gateway.router import Router

# Failures of the connection itself: before the first output, the request can go elsewhere unharmed.
CONNECTION_LOST = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                   httpx.WriteError, httpx.PoolTimeout)  # fmt: skip
ATTEMPTS = 2  # the first replica, then one other


class NoOutput(Exception):
    """The replica's stream ended before any event carried output."""


def tenant_headers(tenant: str | None, master: str | None) -> dict[str, str]:
    """The request's tenant for the engine, when the gateway holds the master token (without it engines
    would refuse the name). What the picker hands Envoy: a name, never a credential."""
    return {HEADER_TENANT: tenant} if master and tenant else {}


def upstream_headers(tenant: str | None, master: str | None) -> dict[str, str]:
    """Only what the engine needs from the relay: the body's type and, with the master token, the tenant
    and the gateway's credential (behind Envoy, Envoy's route adds the credential itself). The client's own
    headers (its API key, any X-Flotilla-* it sent) stay here."""
    headers = {"content-type": "application/json"} | tenant_headers(tenant, master)
    if HEADER_TENANT in headers and master:
        headers[HEADER_GATEWAY_TOKEN] = gateway_token(master)
    return headers


@dataclass
class Exchange:
    """An open upstream response and the replica it came from; `close` ends both (idempotent).

    `head` is what was read before the response was committed: a stream's bytes up to its first output,
    or a whole body (`complete`). `rest` yields a stream's remaining bytes."""

    response: httpx.Response
    decision: Decision
    router: Router
    closed: bool = False
    head: bytes = b""
    complete: bool = False
    _chunks: AsyncIterator[bytes] | None = field(default=None, repr=False)

    async def read_head(self, stream: bool) -> None:
        if not stream:
            self.head, self.complete = await self.response.aread(), True
            return
        self._chunks = self.response.aiter_raw()
        async for chunk in self._chunks:
            self.head += chunk
            if has_output(self.head):
                return
        if not self.head.strip():
            raise NoOutput("the stream ended before any output")
        self.complete = True  # ended cleanly with events but no token: the engine's whole answer

    async def rest(self) -> AsyncIterator[bytes]:
        if self.complete or self._chunks is None:
            return
        async for chunk in self._chunks:
            yield chunk

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
    stream: bool,
    retry_not_found: bool = False,
) -> Exchange:
    """The upstream response, read up to its first output (see the module's docstring). `current` gives
    the service as it is now, so a retry sees the replicas the watches know of by then. `retry_not_found`
    (a LoRA adapter's request): a 404 is retried on another replica as a 503 is, since a replica whose
    engine restarted has lost the adapter until the operator's next round loads it again, while its
    LoRAAdapter's status still says Loaded."""
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
        exchange: Exchange | None = None
        try:
            response = await client.send(request, stream=True)
            exchange = Exchange(response, decision, router)
            retry = response.status_code == 503 or (retry_not_found and response.status_code == 404)
            if retry and attempt + 1 < ATTEMPTS:
                why = f"{decision.endpoint.pod}: {response.status_code} (not serving it)"
                await exchange.close()
            else:
                if response.status_code == 200:
                    await exchange.read_head(stream)
                metrics.decisions.labels(decision.reason).inc()
                return exchange
        except (*CONNECTION_LOST, NoOutput) as exc:
            why = f"{decision.endpoint.pod}: {type(exc).__name__}: {exc}"
            if exchange is not None:
                await exchange.close()
            else:
                router.finished(url)
        except BaseException:  # cancelled (the client went away) or a bug: nothing may stay open
            if exchange is not None:
                await exchange.close()
            else:
                router.finished(url)
            raise
        exclude.add(url)
        if attempt + 1 < ATTEMPTS:
            metrics.retries.labels(model_label).inc()
    raise GatewayError(503, f"no replica could take the request ({why}); retry later",
                       code="upstream_unavailable", headers={"Retry-After": "1"})  # fmt: skip
