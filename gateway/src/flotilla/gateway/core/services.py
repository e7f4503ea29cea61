"""What the gateway knows about an InferenceService, from the raw Kubernetes JSON (camelCase) of the object
and its pods. Frozen views, so a request works on one consistent snapshot while watches replace them.

The gateway does not import the operator (whose pydantic types describe the same objects): it reads only
the few fields routing needs, and tolerates everything else being absent, as a half-reconciled object is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from flotilla import ownership
from flotilla.contract import ENGINE_PORT
from flotilla.gateway.core.adapters import AdapterView
from flotilla.ownership import Owner

# The engine's KV block size when spec.engine.blockSize is unset: flotilla.engine.config.EngineConfig's
# block_size default. Not imported: the gateway does not depend on the engine. The prefix hashes of a
# service's prompts must use its real block size, or no predicted hit is a hit.
DEFAULT_BLOCK_SIZE = 16

_GONE_PHASES = ("Succeeded", "Failed")  # pods that keep an IP but serve nothing again


@dataclass(frozen=True)
class Endpoint:
    """One engine replica: `url` is its base (http://10.0.0.5:8000), without OPENAI_PATH."""

    url: str
    pod: str
    ready: bool
    draining: bool  # the pod is being deleted: it finishes what it has, so it gets nothing new


@dataclass(frozen=True)
class ServiceView:
    namespace: str
    name: str
    served_name: str  # what clients send as "model"
    tenant: str | None  # the Tenant owning the namespace; None: no Tenant (unowned), or several (contested)
    min_replicas: int | None  # spec.autoscaling.minReplicas; None without autoscaling
    desired_replicas: int  # status.desiredReplicas
    gpus_per_replica: int
    endpoints: tuple[Endpoint, ...] = ()
    quota_refusal: str | None = None  # why quota gives the service no replica, if it does not
    block_size: int | None = None  # spec.engine.blockSize; None: the engine's default
    contested: bool = False  # several Tenants claim the namespace: nobody may use the service
    shared: bool = False  # the namespace is the platform's shared Tenant's (Owner.shared): every tenant's
    # A LoRA adapter's routing view (adapter_route): the base service `namespace/name` with `served_name` the
    # adapter's object's name, `adapter` its name in the engines (what the request sends upstream),
    # `adapter_id` its LoRAAdapter's `namespace/name`, and only the endpoints where the operator reports the
    # adapter Loaded.
    adapter: str | None = None
    adapter_id: str | None = None
    adapter_refusal: str | None = None  # why the adapter cannot be served now and will not be soon

    @property
    def key(self) -> str:
        """The unique id of what requests are routed to (holds, prefix tables, demand): `namespace/name`
        for a service, `namespace/base:adapter` for an adapter (':' is in no Kubernetes name)."""
        base = f"{self.namespace}/{self.name}"
        return f"{base}:{self.adapter}" if self.adapter else base

    @property
    def base_key(self) -> str:
        """The service's `namespace/name`; for an adapter its base's (whose tokenizer it uses)."""
        return f"{self.namespace}/{self.name}"

    @property
    def model_id(self) -> str:
        """`namespace/name`: the id clients may send for it (an adapter's is its LoRAAdapter's)."""
        return self.adapter_id or f"{self.namespace}/{self.name}"

    @property
    def upstream_model(self) -> str:
        """The `model` the engine knows it by: the served name, or the adapter's name in the engines."""
        return self.adapter or self.served_name

    @property
    def effective_block_size(self) -> int:
        return self.block_size or DEFAULT_BLOCK_SIZE


def service_view(
    obj: dict[str, Any], pods: list[dict[str, Any]], owner_of_namespace: Callable[[str], Owner]
) -> ServiceView:
    """The view of an InferenceService `obj` whose pods (already selected by the caller) are `pods`;
    `owner_of_namespace` is flotilla.ownership's rule over the fleet's Tenants and namespaces."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    namespace, name = meta.get("namespace") or "default", meta.get("name") or ""
    autoscaling = spec.get("autoscaling")
    desired = int(status.get("desiredReplicas") or 0)
    owner = owner_of_namespace(namespace)
    return ServiceView(
        namespace=namespace,
        name=name,
        served_name=(spec.get("model") or {}).get("servedName") or name,
        tenant=owner.tenant,
        contested=owner.contested,
        shared=owner.shared,
        # minReplicas defaults to 1 in the CRD (flotilla.operator.api.v1alpha1.Autoscaling).
        min_replicas=int(autoscaling.get("minReplicas", 1)) if isinstance(autoscaling, dict) else None,
        desired_replicas=desired,
        gpus_per_replica=int((spec.get("resources") or {}).get("gpus", 1)),
        endpoints=tuple(sorted(filter(None, map(_endpoint, pods)), key=lambda e: e.url)),
        quota_refusal=_quota_refusal(status.get("conditions") or [], desired),
        block_size=(spec.get("engine") or {}).get("blockSize") or None,
    )


def _endpoint(pod: dict[str, Any]) -> Endpoint | None:
    """None for a pod that has no address yet, or has finished for good."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or status.get("phase") in _GONE_PHASES:
        return None
    host = f"[{ip}]" if ":" in ip else ip  # an IPv6 address needs brackets in a URL
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    return Endpoint(
        url=f"http://{host}:{ENGINE_PORT}",
        pod=meta.get("name") or "",
        ready=ready,
        draining=bool(meta.get("deletionTimestamp")),
    )


def _quota_refusal(conditions: list[dict[str, Any]], desired_replicas: int) -> str | None:
    """Why quota gives the service no replica (the operator's own message), so that a held request is
    refused at once with it instead of waiting for a replica that cannot come. Degraded/QuotaLimited alone
    means fewer replicas than asked: a refusal only when quota admits none at all."""
    by_type = {c.get("type"): c for c in conditions}
    admitted = by_type.get("QuotaAdmitted")
    if admitted is not None and admitted.get("status") == "False":
        return admitted.get("message") or "the tenant's quota does not admit this service"
    degraded = by_type.get("Degraded")
    if (
        desired_replicas == 0
        and degraded is not None
        and degraded.get("status") == "True"
        and degraded.get("reason") == "QuotaLimited"
    ):
        return degraded.get("message") or "the tenant's quota admits no replica of this service"
    return None


def routable(service: ServiceView) -> list[Endpoint]:
    """The endpoints a new request may go to: ready, and not being deleted."""
    return [e for e in service.endpoints if e.ready and not e.draining]


def scales_from_zero(service: ServiceView) -> bool:
    """Whether a request for the service with no routable endpoint should be held (and signal demand)
    rather than refused: its autoscaler may take it to zero, and brings it back on demand."""
    return service.min_replicas == 0


def adapter_route(adapter: AdapterView, base: ServiceView | None) -> ServiceView:
    """What a request for `adapter` is routed by: its base service (`base`, None when it does not exist)
    narrowed to the replicas where the operator reports the adapter Loaded. Requests for it are held (as
    for a service without a ready replica) while it is loading; `adapter_refusal` says why none is coming:
    no base service, the operator's Ready condition says no load can succeed (adapters.BLOCKED_REASONS),
    or every ready replica of the base refused the adapter."""
    if base is None:
        return ServiceView(
            namespace=adapter.base_namespace, name=adapter.service, served_name=adapter.name,
            tenant=adapter.tenant, contested=adapter.contested, shared=adapter.shared, min_replicas=None,
            desired_replicas=0,
            gpus_per_replica=0, adapter=adapter.engine_name, adapter_id=adapter.key,
            adapter_refusal=f"its base InferenceService {adapter.service!r} does not exist",
        )  # fmt: skip
    endpoints = tuple(e for e in base.endpoints if e.pod in adapter.loaded_pods)
    refusal = adapter.blocked
    ready = {e.pod for e in routable(base)}
    failed = dict(adapter.failures)
    if refusal is None and not endpoints and ready and not adapter.pending and ready <= failed.keys():
        pod = min(ready)
        refusal = f"every ready replica of its base failed to load it ({pod}: {failed[pod]})"
    return replace(base, served_name=adapter.name, endpoints=endpoints, adapter=adapter.engine_name,
                   adapter_id=adapter.key, adapter_refusal=refusal, tenant=adapter.tenant,
                   contested=adapter.contested, shared=adapter.shared)  # fmt: skip


# -- which service a request's "model" names, and who may use it ------------------------------------------


def may_use(tenant: str | None, service: ServiceView) -> bool:
    """A service in a namespace of the platform's shared Tenant is every tenant's; one in a tenant's
    namespace is that tenant's alone; one in a namespace no Tenant owns, or several Tenants claim, is
    nobody's. A caller without a tenant (no API keys: a static fleet) sees only shared ones. An adapter's
    view carries its own namespace's owner (adapter_route), so an adapter on a shared base is its tenant's."""
    return ownership.may_use(tenant, service.tenant, contested=service.contested, shared=service.shared)


@dataclass(frozen=True)
class NotFound:
    """No model of that name that the caller may use: whether another tenant has one is not said (the
    same answer, byte for byte, as for a name nobody has), so a key cannot probe other tenants' names."""

    model: str
    status: int = 404
    code: str = "model_not_found"

    @property
    def message(self) -> str:
        return f"the model {self.model!r} does not exist"


@dataclass(frozen=True)
class Ambiguous:
    """Several services the caller may use serve this name; `candidates` are their `namespace/name` ids,
    only ever ones the caller may use."""

    model: str
    candidates: tuple[str, ...]
    status: int = 400
    code: str = "model_ambiguous"

    @property
    def message(self) -> str:
        return f"the model name {self.model!r} is ambiguous: send 'namespace/name', one of " + ", ".join(
            repr(c) for c in self.candidates
        )


ResolveError = NotFound | Ambiguous


class ModelIndex:
    """Every InferenceService and LoRA adapter the gateway knows, by `namespace/name` and by served name
    (an adapter's is its object's name). Immutable: the gateway builds a new index when a watch changes
    something and swaps it in."""

    def __init__(self, services: Iterable[ServiceView] = (), adapters: Iterable[AdapterView] = ()) -> None:
        self._by_key: dict[str, ServiceView] = {s.key: s for s in services}
        self._by_served: dict[str, list[ServiceView]] = {}
        for service in sorted(self._by_key.values(), key=lambda s: s.key):
            self._by_served.setdefault(service.served_name, []).append(service)
        # Adapters: by `namespace/name` (model_id), by routing key, and by name beside the served names.
        self._adapter_by_id: dict[str, ServiceView] = {}
        self._adapter_routes: dict[str, ServiceView] = {}
        for adapter in sorted(adapters, key=lambda a: a.key):
            base = self._by_key.get(adapter.service_key)
            view = adapter_route(adapter, base)
            self._adapter_by_id[view.model_id] = view
            self._adapter_routes[view.key] = view
            # One named like its own base's model (refused by the operator: NameTaken) never shadows the
            # base: only its `namespace/name` reaches it, to be told why it is refused.
            if base is None or base.served_name != view.served_name:
                self._by_served.setdefault(view.served_name, []).append(view)

    def __len__(self) -> int:
        return len(self._by_key)

    def services(self) -> list[ServiceView]:
        return sorted(self._by_key.values(), key=lambda s: s.key)

    def adapters(self) -> list[ServiceView]:
        """Every adapter's routing view, by key."""
        return sorted(self._adapter_routes.values(), key=lambda s: s.key)

    def get(self, key: str) -> ServiceView | None:
        """The service or adapter of routing key `key` (ServiceView.key), visible or not (for the server's
        own bookkeeping, not requests)."""
        return self._by_key.get(key) or self._adapter_routes.get(key)

    def resolve(self, model: str, tenant: str | None) -> ServiceView | ResolveError:
        """The service `model` names for a caller of `tenant`.

        `namespace/name` always names that service (checked first: a served name may itself contain a '/',
        like 'org/model', and still works when no service has that key). A bare served name names the one
        service the caller may use that serves it; other tenants' services of the same name do not make it
        ambiguous, and are never listed. Another tenant's name is not found, as a name nobody has.

        LoRA adapters are names like served names (their object's name; `namespace/name` after the
        services' keys): an adapter and a service the caller may both use under one name are ambiguous,
        like two services, and the answer lists their `namespace/name` ids. Its namespace's owner alone may
        use an adapter (may_use: the rule of its base service, which is in the same namespace).
        """
        service = self._by_key.get(model) or self._adapter_by_id.get(model)
        if service is not None:
            return service if may_use(tenant, service) else NotFound(model)
        serving = self._by_served.get(model, [])
        usable = [s for s in serving if may_use(tenant, s)]
        if len(usable) == 1:
            return usable[0]
        if usable:
            return Ambiguous(model, tuple(s.model_id for s in usable))
        return NotFound(model)

    def visible_models(self, tenant: str | None) -> list[tuple[str, ServiceView]]:
        """(id, view) for /v1/models: every service and adapter the caller may use, by its served name
        when that resolves to it for this caller, else by `namespace/name`. Sorted by id."""
        models = []
        for service in [*self._by_key.values(), *self._adapter_routes.values()]:
            if not may_use(tenant, service):
                continue
            models.append((self._id_for(service, tenant), service))
        return sorted(models, key=lambda pair: (pair[0], pair[1].key))

    def parent_id(self, adapter: ServiceView, tenant: str | None) -> str:
        """An adapter's `parent` in /v1/models: the id its base service has there for this caller (its
        `namespace/name` when the base is gone)."""
        base = self._by_key.get(adapter.base_key)
        return self._id_for(base, tenant) if base is not None else adapter.base_key

    def _id_for(self, service: ServiceView, tenant: str | None) -> str:
        bare = self.resolve(service.served_name, tenant)
        return service.served_name if bare is service else service.model_id
