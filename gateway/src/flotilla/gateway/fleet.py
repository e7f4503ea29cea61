"""The gateway's picture of the fleet: InferenceServices with their pods, LoRAAdapters, Tenants (who owns which namespace,
and their rate limits) and the tenants' API keys, kept current by watches on the Kubernetes API.

Each change rebuilds the frozen views (services.ModelIndex, keys.KeyRing) whole, so a request reads one
consistent snapshot; fleets are small enough that a rebuild per event costs microseconds. `on_change` runs
after every rebuild: the app releases held requests whose service got a ready replica there.

A static fleet (fixed endpoints per model, no Kubernetes) serves benchmarks and tests of the routing alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from flotilla.contract import (
    ANNOTATION_DEMAND,
    API_GROUP,
    API_KEY_SECRET_LABEL,
    API_VERSION,
    INFERENCE_SERVICES,
    LORA_ADAPTERS,
    POD_SERVICE_LABEL,
    TENANTS,
)
from flotilla.gateway.core.adapters import adapter_view
from flotilla.gateway.core.keys import KeyRing
from flotilla.gateway.core.rate_limit import RateLimits, rate_limits_of
from flotilla.gateway.core.services import Endpoint, ModelIndex, ServiceView, service_view
from flotilla.gateway.kube import Kube, WatchEvent
from flotilla.ownership import Owner, owner_of

log = logging.getLogger("flotilla.gateway.fleet")

Key = tuple[str, str]  # (namespace, name)


def _key(obj: dict) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


class Fleet:
    def __init__(self) -> None:
        self.index = ModelIndex()
        self.keys = KeyRing.from_secrets([])
        self.limits: dict[str, RateLimits] = {}
        self.on_change: Callable[[], None] = lambda: None
        self.synced = asyncio.Event()  # set once every watch has listed (or at once for a static fleet)

    def rate_limits(self, tenant: str) -> RateLimits:
        return self.limits.get(tenant) or RateLimits(None, None)

    def endpoint_urls(self) -> list[str]:  # an adapter's replicas are its base's
        return [e.url for s in self.index.services() for e in s.endpoints if e.ready]

    async def run(self) -> None:
        """Keeps the picture current until cancelled (nothing to do for a static fleet)."""
        self.synced.set()
        await asyncio.Event().wait()

    async def demand(self, service: ServiceView, stamp: str) -> None:
        """Tells the operator that requests wait for `service` (a static fleet has no operator)."""


class StaticFleet(Fleet):
    """`--static-model NAME=URL,URL`: fixed, always-ready replicas of shared services, no Kubernetes."""

    def __init__(self, models: dict[str, list[str]]) -> None:
        super().__init__()
        self.index = ModelIndex(
            [
                ServiceView(
                    namespace="static",
                    name=name,
                    served_name=name,
                    tenant=None,
                    shared=True,  # no tenants and no keys: every caller's
                    min_replicas=None,
                    desired_replicas=len(urls),
                    gpus_per_replica=0,
                    endpoints=tuple(
                        Endpoint(url.rstrip("/"), f"{name}-{i}", True, False) for i, url in enumerate(urls)
                    ),
                )  # fmt: skip
                for name, urls in models.items()
            ]
        )


class KubeFleet(Fleet):
    """Watches InferenceServices and their pods cluster-wide, LoRAAdapters, Tenants, namespaces (their labels: a Tenant
    may claim a namespace by label), and the key Secrets in one namespace (the gateway's own: reading
    Secrets anywhere else is a privilege it does not need)."""

    def __init__(self, kube: Kube, keys_namespace: str) -> None:
        super().__init__()
        self.kube, self.keys_namespace = kube, keys_namespace
        self.services: dict[Key, dict] = {}
        self.pods: dict[Key, dict] = {}
        self.adapters: dict[Key, dict] = {}
        self.tenants: dict[str, dict] = {}
        self.namespaces: dict[str, dict] = {}
        self.secrets: dict[Key, dict] = {}
        self._listed: set[str] = set()

    async def run(self) -> None:
        group = f"/apis/{API_GROUP}/{API_VERSION}"
        watches = {
            "services": (f"{group}/{INFERENCE_SERVICES}", None, self.services),
            "pods": ("/api/v1/pods", {"labelSelector": POD_SERVICE_LABEL}, self.pods),
            "adapters": (f"{group}/{LORA_ADAPTERS}", None, self.adapters),
            "tenants": (f"{group}/{TENANTS}", None, self.tenants),
            "namespaces": ("/api/v1/namespaces", None, self.namespaces),
            "secrets": (
                f"/api/v1/namespaces/{self.keys_namespace}/secrets",
                {"labelSelector": API_KEY_SECRET_LABEL},
                self.secrets,
            ),  # fmt: skip
        }
        async with asyncio.TaskGroup() as group_tasks:
            for name, (path, params, store) in watches.items():
                group_tasks.create_task(
                    self.kube.watch(path, self._handler(name, store, len(watches)), params)
                )

    def _handler(self, name: str, store: dict, total: int) -> Callable[[WatchEvent], None]:
        by_name = store is self.tenants or store is self.namespaces  # cluster-scoped kinds

        def key_of(obj: dict) -> Any:
            return (obj.get("metadata") or {}).get("name") if by_name else _key(obj)

        def handle(event: WatchEvent) -> None:
            kind, obj = event
            if kind == "SYNCED":
                store.clear()
                store.update({key_of(item): item for item in obj["items"]})
                self._listed.add(name)
                if len(self._listed) == total:
                    self.synced.set()
            elif kind == "DELETED":
                store.pop(key_of(obj), None)
            else:
                store[key_of(obj)] = obj
            self._rebuild()

        return handle

    def _rebuild(self) -> None:
        specs = {name: tenant.get("spec") or {} for name, tenant in self.tenants.items()}
        labels = {
            name: (ns.get("metadata") or {}).get("labels") or {} for name, ns in self.namespaces.items()
        }
        pods_of: dict[Key, list[dict]] = {}
        for (namespace, _), pod in self.pods.items():
            service = ((pod.get("metadata") or {}).get("labels") or {}).get(POD_SERVICE_LABEL)
            if service:
                pods_of.setdefault((namespace, service), []).append(pod)

        def owner(namespace: str) -> Owner:
            return owner_of(namespace, specs, labels)

        self.index = ModelIndex(
            [service_view(obj, pods_of.get(key, []), owner) for key, obj in sorted(self.services.items())],
            [adapter_view(obj, owner) for _, obj in sorted(self.adapters.items())],
        )
        self.keys = KeyRing.from_secrets(self.secrets.values())
        self.limits = {name: rate_limits_of(tenant) for name, tenant in self.tenants.items()}
        try:
            self.on_change()
        except Exception:  # a bug in a listener must not stop the watches
            log.exception("on_change failed")

    async def demand(self, service: ServiceView, stamp: str) -> None:
        path = f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{service.namespace}/{INFERENCE_SERVICES}/{service.name}"
        try:
            await self.kube.merge_patch(path, {"metadata": {"annotations": {ANNOTATION_DEMAND: stamp}}})
        except Exception as exc:  # the held request times out with its own message; say why here
            log.warning("cannot signal demand for %s: %s", service.key, exc)
