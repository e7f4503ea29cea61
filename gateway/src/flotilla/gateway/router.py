"""The routing state around the pure picker: per service, a prefix table (sized to its replicas' KV caches)
and a round-robin counter; per endpoint, the requests the gateway has in flight there."""

from __future__ import annotations

from dataclasses import dataclass, field

from flotilla.gateway.core.picker import Decision, EndpointLoad, Routing, pick
from flotilla.gateway.core.prefix_table import DEFAULT_BLOCKS_PER_REPLICA, PrefixTable, capacity_for
from flotilla.gateway.core.services import ServiceView, routable
from flotilla.gateway.engine_stats import EngineStats


@dataclass
class _ServiceRoutes:
    table: PrefixTable
    turns: int = 0
    urls: frozenset[str] = field(default_factory=frozenset)


class Router:
    def __init__(self, policy: Routing, stats: EngineStats) -> None:
        self.policy: Routing = policy
        self.stats = stats
        self.in_flight: dict[str, int] = {}
        self.services: dict[str, _ServiceRoutes] = {}

    def choose(
        self, service: ServiceView, hashes: list[int], exclude: set[str], blocks_per_replica: int | None
    ) -> Decision | None:
        candidates = routable(service)
        routes = self._routes(service, blocks_per_replica)
        urls = [e.url for e in candidates]
        # Matched under every policy, so the predicted-hit metric compares them; only `prefix` acts on it.
        hits = routes.table.match(hashes, urls) if hashes else {}
        loads = {url: self._load(url) for url in urls}
        decision = pick(self.policy, candidates, loads, hits, len(hashes), routes.turns, exclude)
        routes.turns += 1
        if decision is not None and hashes:
            routes.table.record(hashes, decision.endpoint.url)
        return decision

    def fallback(self, service: ServiceView, exclude: set[str]) -> str | None:
        """The replica a request goes to when its pick refuses it before answering (the data plane's retry):
        the least loaded routable one not in `exclude`, or None."""
        urls = [e.url for e in routable(service) if e.url not in exclude]
        loads = {url: self._load(url) for url in urls}
        return min(urls, key=lambda url: (loads[url].in_flight + loads[url].waiting, url), default=None)

    def _load(self, url: str) -> EndpointLoad:
        waiting, kv_usage = self.stats.load(url)
        return EndpointLoad(self.in_flight.get(url, 0), waiting, kv_usage)

    def _routes(self, service: ServiceView, blocks_per_replica: int | None) -> _ServiceRoutes:
        """The service's state; its table forgets replicas that are gone and follows the replica count."""
        urls = frozenset(e.url for e in service.endpoints)
        capacity = capacity_for(len(urls), blocks_per_replica or DEFAULT_BLOCKS_PER_REPLICA)
        routes = self.services.get(service.key)
        if routes is None:
            routes = self.services[service.key] = _ServiceRoutes(PrefixTable(capacity), urls=urls)
        if routes.urls != urls:
            for gone in routes.urls - urls:
                routes.table.forget(gone)
            routes.urls = urls
        if routes.table.capacity != capacity:
            routes.table.set_capacity(capacity)
        return routes

    def started(self, url: str) -> None:
        self.in_flight[url] = self.in_flight.get(url, 0) + 1

    def finished(self, url: str) -> None:
        left = self.in_flight.get(url, 0) - 1
        if left > 0:
            self.in_flight[url] = left
        else:
            self.in_flight.pop(url, None)

    def forget_services(self, keep: set[str]) -> None:
        for key in [k for k in self.services if k not in keep]:
            del self.services[key]
