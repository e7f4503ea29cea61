"""The engines Envoy may connect to, served to it over EDS (Envoy's endpoint discovery, gRPC) from the
picker's port: every replica the fleet knows, of every service, ready or not yet.

Why Envoy needs them: the pick names one engine and a fallback (`ip:port,ip:port`), and Envoy's override-host
load balancing sends the request to the first and, when that one refuses or resets before answering, retries
it on the next (the relay's retry before the first token). Override-host picks only among the hosts its
cluster has, so the cluster is this list, kept current as pods come and go.

Envoy acknowledges each version it applied (ACK: a request carrying the version's nonce and no error).
Each Envoy is known by its node id (the `node` of its first EDS request; its ext_proc calls carry the same
id in ENVOY_NODE_METADATA), and `acked(node)` is what that Envoy has applied: the picker picks for a
request only from what the Envoy that asks has applied, so a pick never names an engine that Envoy does not
know yet (a new replica waits for its ACK), and an Envoy that never ACKs (stalled, or a rogue subscriber
with the picker's credential) holds back only its own requests. A caller that names no node, or a node that
has not subscribed (a gateway of another vendor, with its own endpoints), gets None: no restriction.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from flotilla.gateway.extproc.protos import (
    Address,
    AnyMessage,
    ClusterLoadAssignment,
    DiscoveryResponse,
    EndpointDiscoveryServiceServicer,
    HealthStatus,
    LbEndpoint,
    LocalityLbEndpoints,
    SocketAddress,
    UpstreamEndpoint,
)

log = logging.getLogger("flotilla.gateway.extproc.endpoints")
CLA_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def split_address(address: str) -> tuple[str, int]:
    """`ip:port` (IPv6 in brackets) as (ip, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def load_assignment(cluster: str, addresses: Iterable[str]) -> Any:
    """The ClusterLoadAssignment of `cluster`: each address one endpoint, HEALTHY (the picker judges
    readiness; Envoy only connects where it is told)."""
    endpoints = [
        LbEndpoint(
            endpoint=UpstreamEndpoint(
                address=Address(socket_address=SocketAddress(address=ip, port_value=port))
            ),
            health_status=HealthStatus.HEALTHY,
        )
        for ip, port in sorted(split_address(a) for a in addresses)
    ]
    return ClusterLoadAssignment(
        cluster_name=cluster, endpoints=[LocalityLbEndpoints(lb_endpoints=endpoints)]
    )


class EndpointPublisher:
    """The versioned set of engine addresses and what each subscribed Envoy has acknowledged. Runs on the
    gateway's loop; `refresh` is called on every fleet change."""

    def __init__(self, addresses: Callable[[], Iterable[str]]) -> None:
        self._source = addresses
        self.version = 0
        self.addresses: frozenset[str] = frozenset()
        self._acked: dict[int, frozenset[str]] = {}  # subscriber -> the addresses of its last ACKed version
        self._subscribers: dict[int, str] = {}  # subscriber -> its Envoy's node id ("" until it says)
        self._ids = itertools.count(1)
        self._changed: asyncio.Condition | None = None

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def refresh(self) -> None:
        addresses = frozenset(self._source())
        if addresses != self.addresses:
            self.addresses, self.version = addresses, self.version + 1
            self._schedule_notify()

    def _schedule_notify(self) -> None:
        with contextlib.suppress(RuntimeError):  # no running loop yet: nobody waits
            asyncio.get_running_loop().create_task(self._notify())

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def acked(self, node: str | None) -> frozenset[str] | None:
        """The addresses the Envoy `node` has applied (its latest stream's: a reconnected Envoy's old
        stream may linger); None when no stream of that node subscribes, or no node is named."""
        streams = [s for s, n in self._subscribers.items() if node and n == node]
        if not streams:
            return None
        return self._acked.get(max(streams), frozenset())

    async def wait_acked(self, addresses: set[str], timeout: float, node: str | None) -> bool:
        """Waits until the Envoy `node` knows at least one of `addresses` (at once when it does not
        subscribe); False after `timeout`."""

        def known() -> bool:
            acked = self.acked(node)
            return acked is None or bool(acked & addresses)

        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(known), timeout)
            except TimeoutError:
                return False
        return True

    # -- one Envoy's stream -------------------------------------------------------------------------------
    def subscribe(self) -> int:
        subscriber = next(self._ids)
        self._subscribers[subscriber] = ""
        return subscriber

    def identify(self, subscriber: int, node: str) -> None:
        """The subscriber's Envoy said its node id (its first request does)."""
        if subscriber in self._subscribers and node:
            self._subscribers[subscriber] = node

    def unsubscribe(self, subscriber: int) -> None:
        self._subscribers.pop(subscriber, None)
        self._acked.pop(subscriber, None)
        self._schedule_notify()

    def ack(self, subscriber: int, addresses: frozenset[str]) -> None:
        self._acked[subscriber] = addresses
        self._schedule_notify()


class EndpointDiscovery(EndpointDiscoveryServiceServicer):
    """EDS over one gRPC stream per Envoy (state of the world): a response at the start and on each change;
    Envoy's ACKs recorded, a NACK logged (the previous version stays in force in that Envoy)."""

    def __init__(self, publisher: EndpointPublisher) -> None:
        self.publisher = publisher

    async def StreamEndpoints(  # noqa: N802  (the gRPC method's name)
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> None:
        publisher = self.publisher
        subscriber = publisher.subscribe()
        sent: dict[str, frozenset[str]] = {}  # nonce -> the addresses of that response
        clusters: list[str] = []
        asked = asyncio.Event()

        async def read() -> None:
            async for request in request_iterator:
                if request.HasField("node"):
                    publisher.identify(subscriber, request.node.id)
                if request.resource_names and not clusters:
                    clusters.extend(request.resource_names)
                if request.response_nonce in sent:
                    addresses = sent.pop(request.response_nonce)
                    if request.HasField("error_detail"):
                        log.warning("Envoy refused the engines' endpoints: %s", request.error_detail.message)
                    else:
                        publisher.ack(subscriber, addresses)
                asked.set()

        async def write() -> None:
            await asked.wait()
            version = -1
            while True:
                async with publisher.changed:
                    await publisher.changed.wait_for(
                        lambda sent_version=version: publisher.version != sent_version
                    )
                version, addresses = publisher.version, publisher.addresses
                nonce = f"{subscriber}-{version}"
                sent[nonce] = addresses
                resources = []
                for cluster in clusters or [""]:
                    packed = AnyMessage()
                    packed.Pack(load_assignment(cluster, addresses))
                    resources.append(packed)
                await context.write(DiscoveryResponse(version_info=str(version), resources=resources,
                                                      type_url=CLA_TYPE, nonce=nonce))  # fmt: skip

        reader, writer = asyncio.ensure_future(read()), asyncio.ensure_future(write())
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, writer):
                task.cancel()
            publisher.unsubscribe(subscriber)
