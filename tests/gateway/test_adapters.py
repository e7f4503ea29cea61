"""LoRA adapters in the gateway: the view of a LoRAAdapter, which adapter a request's model names for which
tenant, its routing view (the base's replicas where it is Loaded), /v1/models' ids, the prefix hashes from
the adapter's root, and the watch wiring (KubeFleet)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from flotilla.contract import LORA_ADAPTERS, prefix_block_hashes, root_block_hash
from flotilla.gateway.core.adapters import AdapterView, adapter_view
from flotilla.gateway.core.services import (
    Ambiguous,
    ModelIndex,
    NotFound,
    ServiceView,
    adapter_route,
    may_use,
    routable,
    service_view,
)
from flotilla.gateway.engine_stats import EngineStats
from flotilla.gateway.fleet import KubeFleet
from flotilla.gateway.kube import Kube
from flotilla.gateway.prompts import PromptHasher, ServiceTokenizer
from flotilla.gateway.rbac import cluster_rules
from flotilla.gateway.router import Router
from flotilla.ownership import Owner

OWNERS = {"team-a": "a", "team-b": "b", "shared": "platform"}
SHARED_TENANTS = {"platform"}  # Tenants with spec.shared: their namespaces' services are every tenant's


def tenant_of(namespace: str) -> Owner:
    owner = OWNERS.get(namespace)
    return Owner(namespace, (owner,) if owner else (), shared=owner in SHARED_TENANTS)


def pod(name: str, ip: str, ready: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


def isvc(namespace: str, name: str, served: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"model": {"uri": "file:///m", "servedName": served}, "engine": {"lora": {"enabled": True}}},
        "status": {"desiredReplicas": 2} | status,
    }


def lora(namespace: str, name: str, service: str = "base", **phases: str) -> dict[str, Any]:
    """A LoRAAdapter whose status has `pod=phase` entries (none: the operator has not written it yet)."""
    replicas = [
        {"pod": p.replace("_", "-"), "phase": phase, "reason": "Refused" if phase == "Failed" else "",
         "message": "rank 128 is above maxLoraRank 64" if phase == "Failed" else ""}
        for p, phase in phases.items()
    ]  # fmt: skip
    return {
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"inferenceService": service, "source": f"file:///srv/adapters/{name}"},
        "status": {"replicas": replicas} if replicas else {},
    }


PODS = [pod("base-0", "10.0.0.1"), pod("base-1", "10.0.0.2"), pod("base-2", "10.0.0.3")]


def base(namespace: str = "team-a", pods: list[dict] | None = None) -> ServiceView:
    return service_view(isvc(namespace, "base", "tiny"), PODS if pods is None else pods, tenant_of)


def adapter(obj: dict[str, Any]) -> AdapterView:
    return adapter_view(obj, tenant_of)


# -- the view ------------------------------------------------------------------------------------------------
def test_view_reads_the_base_and_each_replicas_phase() -> None:
    view = adapter(lora("team-a", "sql", base_0="Loaded", base_1="Loading", base_2="Failed"))
    assert (view.namespace, view.name, view.service, view.tenant) == ("team-a", "sql", "base", "a")
    assert view.loaded_pods == {"base-0"} and view.pending == 1
    assert view.failures == (("base-2", "rank 128 is above maxLoraRank 64"),)
    assert view.key == "team-a/sql" and view.service_key == "team-a/base"
    fresh = adapter(lora("team-a", "sql"))  # no status yet: loaded nowhere
    assert fresh.loaded_pods == frozenset() and fresh.failures == () and fresh.pending == 0


def test_route_is_the_base_narrowed_to_replicas_where_it_is_loaded() -> None:
    route = adapter_route(adapter(lora("team-a", "sql", base_0="Loaded", base_2="Loaded")), base())
    assert route.adapter == "sql" and route.served_name == "sql" and route.adapter_refusal is None
    assert [e.pod for e in routable(route)] == ["base-0", "base-2"]
    assert (
        route.key == "team-a/base:sql" and route.base_key == "team-a/base" and route.model_id == "team-a/sql"
    )
    # A Loaded entry for a pod that is not ready (or gone) is no endpoint.
    not_ready = base(pods=[pod("base-0", "10.0.0.1", ready=False), PODS[1]])
    assert routable(adapter_route(adapter(lora("team-a", "sql", base_0="Loaded")), not_ready)) == []


def test_loading_is_held_and_only_a_failure_everywhere_or_no_base_is_refused() -> None:
    loading = adapter_route(adapter(lora("team-a", "sql", base_0="Loading", base_1="Failed")), base())
    assert routable(loading) == [] and loading.adapter_refusal is None  # held: the operator retries
    unknown = adapter_route(adapter(lora("team-a", "sql")), base())
    assert unknown.adapter_refusal is None  # no status yet: held
    failed = adapter_route(
        adapter(lora("team-a", "sql", base_0="Failed", base_1="Failed", base_2="Failed")), base()
    )
    assert failed.adapter_refusal is not None and "maxLoraRank" in failed.adapter_refusal
    no_base = adapter_route(adapter(lora("team-a", "sql", service="gone")), None)
    assert no_base.adapter_refusal is not None and "'gone' does not exist" in no_base.adapter_refusal
    assert no_base.key == "team-a/gone:sql" and routable(no_base) == []


# -- resolution ------------------------------------------------------------------------------------------------
def index() -> ModelIndex:
    return ModelIndex(
        [base("team-a"), base("team-b"), service_view(isvc("shared", "chat", "chat"), PODS, tenant_of)],
        [
            adapter(lora("team-a", "sql", base_0="Loaded")),
            adapter(lora("team-b", "sql", base_1="Loaded")),
            adapter(lora("team-b", "secret-b", base_0="Loaded")),
            adapter(lora("team-a", "chat", base_0="Loaded")),  # the name of a shared service's model
            adapter(lora("shared", "helper", service="chat", base_0="Loaded")),
        ],
    )


def test_an_adapter_resolves_for_its_namespaces_tenant_only() -> None:
    idx = index()
    for tenant, namespace in (("a", "team-a"), ("b", "team-b")):
        found = idx.resolve("sql", tenant)  # both have one: each gets its own, no ambiguity
        assert isinstance(found, ServiceView) and found.adapter == "sql" and found.namespace == namespace
        by_id = idx.resolve(f"{namespace}/sql", tenant)
        assert by_id is idx.get(f"{namespace}/base:sql") and by_id is found
    assert may_use("a", idx.resolve("sql", "a"))  # type: ignore[arg-type]


def test_another_tenants_adapter_is_not_found_as_a_name_nobody_has() -> None:
    for model in ("secret-b", "team-b/sql", "team-b/secret-b"):
        result = index().resolve(model, "a")
        assert isinstance(result, NotFound) and result.status == 404
        assert result.message == f"the model {model!r} does not exist"
    assert isinstance(index().resolve("secret-b", None), NotFound)  # no key: shared things only


def test_an_unknown_adapter_is_not_found() -> None:
    for model in ("nope", "team-a/nope", "team-b/nope"):
        result = index().resolve(model, "a")
        assert isinstance(result, NotFound) and result.status == 404


def test_an_adapter_in_a_shared_namespace_is_shared_like_its_base() -> None:
    for tenant in ("a", "b", None):
        found = index().resolve("helper", tenant)
        assert isinstance(found, ServiceView) and found.key == "shared/chat:helper"


def test_an_adapter_named_like_a_served_model_is_ambiguous_for_whoever_may_use_both() -> None:
    result = index().resolve("chat", "a")
    assert isinstance(result, Ambiguous) and result.status == 400
    assert result.candidates == ("shared/chat", "team-a/chat")  # ids that resolve: the service, the adapter
    assert isinstance(index().resolve("shared/chat", "a"), ServiceView)
    service = index().resolve("shared/chat", "a")
    assert isinstance(service, ServiceView) and service.adapter is None
    adapter_ = index().resolve("team-a/chat", "a")
    assert isinstance(adapter_, ServiceView) and adapter_.adapter == "chat"
    # Tenant b may not use team-a's adapter: for b, "chat" is the shared service alone.
    for_b = index().resolve("chat", "b")
    assert isinstance(for_b, ServiceView) and for_b.key == "shared/chat"


def test_visible_models_list_the_callers_adapters_with_their_parent() -> None:
    idx = index()
    models = idx.visible_models("a")
    ids = [model_id for model_id, _ in models]
    assert ids == ["helper", "shared/chat", "sql", "team-a/chat", "tiny"]
    for model_id, view in models:
        assert idx.resolve(model_id, "a") is view
    parents = {model_id: idx.parent_id(view, "a") for model_id, view in models if view.adapter}
    assert parents == {"helper": "shared/chat", "sql": "tiny", "team-a/chat": "tiny"}
    assert [model_id for model_id, _ in idx.visible_models("b")] == [
        "chat",
        "helper",
        "secret-b",
        "sql",
        "tiny",
    ]
    assert [model_id for model_id, _ in idx.visible_models(None)] == ["chat", "helper"]


# -- routing and prefix hashes ----------------------------------------------------------------------------
def test_router_sends_an_adapter_to_the_least_loaded_replica_where_it_is_loaded() -> None:
    stats = EngineStats(lambda: [])
    router = Router("prefix", stats)
    route = adapter_route(adapter(lora("team-a", "sql", base_0="Loaded", base_2="Loaded")), base())
    by_pod = {e.pod: e.url for e in route.endpoints}
    router.started(by_pod["base-0"])  # base-0 busier; base-1 (idle) does not have the adapter
    for _ in range(3):
        decision = router.choose(route, [], set(), None)
        assert decision is not None and decision.endpoint.pod == "base-2"
    router.started(by_pod["base-2"])
    router.started(by_pod["base-2"])
    decision = router.choose(route, [], set(), None)
    assert decision is not None and decision.endpoint.pod == "base-0"
    asyncio.run(stats.close())


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 97 for c in text]


def test_an_adapters_prompt_blocks_chain_from_its_root() -> None:
    async def run() -> None:
        hasher = PromptHasher()
        hasher.tokenizers["team-a/base"] = ServiceTokenizer(cast(Any, _Tokenizer()), 4, True, 100)
        body = {"prompt": "a prompt of several blocks"}
        ids = _Tokenizer().encode(body["prompt"])
        n, base_hashes = await hasher.hashes("team-a/base", [], False, body)
        _, sql_hashes = await hasher.hashes("team-a/base", [], False, body, "sql")
        _, chat_hashes = await hasher.hashes("team-a/base", [], False, body, "chat")
        assert n == len(ids) and len(sql_hashes) == len(ids) // 4
        assert base_hashes == prefix_block_hashes(ids, 4)
        assert sql_hashes == prefix_block_hashes(ids, 4, root=root_block_hash("sql"))
        assert not {*base_hashes} & {*sql_hashes} and not {*sql_hashes} & {*chat_hashes}
        await hasher.close()

    asyncio.run(run())


# -- the watch --------------------------------------------------------------------------------------------
def test_the_fleet_indexes_lora_adapters_from_their_watch() -> None:
    fleet = KubeFleet(cast(Kube, None), "flotilla-system")
    fleet.tenants.update(
        {t: {"metadata": {"name": t}, "spec": {"namespaces": [ns]}} for ns, t in OWNERS.items()}
    )
    fleet.services[("team-a", "base")] = isvc("team-a", "base", "tiny")
    for p in PODS:
        labelled = p | {"metadata": p["metadata"] | {"labels": {"flotilla.dev/inferenceservice": "base"}}}
        fleet.pods[("team-a", p["metadata"]["name"])] = labelled
    changes: list[int] = []
    fleet.on_change = lambda: changes.append(1)
    handle = fleet._handler("adapters", fleet.adapters, 99)  # noqa: SLF001 (what the watch calls)
    handle(("SYNCED", {"items": [lora("team-a", "sql", base_1="Loaded")]}))
    found = fleet.index.resolve("sql", "a")
    assert isinstance(found, ServiceView) and [e.pod for e in routable(found)] == ["base-1"]
    assert isinstance(fleet.index.resolve("sql", "b"), NotFound)
    handle(("MODIFIED", lora("team-a", "sql", base_1="Loaded", base_2="Loaded")))
    found = fleet.index.resolve("sql", "a")
    assert isinstance(found, ServiceView) and [e.pod for e in routable(found)] == ["base-1", "base-2"]
    handle(("DELETED", lora("team-a", "sql")))
    assert isinstance(fleet.index.resolve("sql", "a"), NotFound) and len(changes) == 3


def test_the_gateway_may_read_lora_adapters_and_nothing_more_of_them() -> None:
    rules = [r for r in cluster_rules() if LORA_ADAPTERS in r["resources"]]
    assert [r["verbs"] for r in rules] == [["get", "list", "watch"]]


def blocked(obj: dict[str, Any], reason: str, message: str) -> dict[str, Any]:
    condition = {"type": "Ready", "status": "False", "reason": reason, "message": message}
    obj["status"] = obj.get("status", {}) | {"conditions": [condition]}
    return obj


def test_an_adapter_the_operator_says_cannot_load_is_refused_with_its_message() -> None:
    message = "InferenceService team-a/base does not serve adapters: set its spec.engine.lora.enabled to true"
    view = adapter(blocked(lora("team-a", "sql"), "LoRANotEnabled", message))
    assert view.blocked == message
    assert adapter_route(view, base()).adapter_refusal == message
    # Loading, LoadFailed and NoReadyReplicas are not blocked: held (LoadFailed everywhere: refused above).
    for reason in ("Loading", "LoadFailed", "NoReadyReplicas"):
        assert adapter(blocked(lora("team-a", "sql"), reason, "...")).blocked is None


def test_an_adapter_named_like_its_bases_model_never_shadows_the_base() -> None:
    taken = blocked(lora("team-a", "tiny"), "NameTaken", "the adapter's name 'tiny' is the served model name")
    idx = ModelIndex([base()], [adapter(taken)])
    found = idx.resolve("tiny", "a")
    assert isinstance(found, ServiceView) and found.adapter is None and found.key == "team-a/base"
    by_id = idx.resolve("team-a/tiny", "a")
    assert isinstance(by_id, ServiceView) and by_id.adapter == "tiny"
    assert by_id.adapter_refusal is not None and "NameTaken" not in by_id.adapter_refusal
    assert [model_id for model_id, _ in idx.visible_models("a")] == ["team-a/tiny", "tiny"]


# -- adapters of two tenants on one shared base service --------------------------------------------------------
def shared_lora(namespace: str, name: str, **phases: str) -> dict[str, Any]:
    obj = lora(namespace, name, service="chat", **phases)
    obj["spec"]["serviceNamespace"] = "shared"
    return obj


def shared_index() -> ModelIndex:
    chat = service_view(isvc("shared", "chat", "chat"), PODS, tenant_of)
    adapters = [
        adapter(shared_lora("team-a", "sql", base_0="Loaded")),
        adapter(shared_lora("team-b", "sql", base_1="Loaded")),
        adapter(shared_lora("team-b", "only-b", base_1="Loaded")),
    ]
    return ModelIndex([chat], adapters)


def test_two_tenants_adapters_on_one_shared_base_each_reach_their_own_under_its_engine_name() -> None:
    idx = shared_index()
    for tenant, namespace, pod_name in (("a", "team-a", "base-0"), ("b", "team-b", "base-1")):
        found = idx.resolve("sql", tenant)  # each tenant's own, not ambiguous with the other's
        assert isinstance(found, ServiceView) and found.model_id == f"{namespace}/sql"
        assert found.upstream_model == f"{namespace}/sql"  # the engine's name for it on the shared base
        assert found.adapter == f"{namespace}/sql" and found.base_key == "shared/chat"
        assert found.namespace == "shared"  # routed (and given the engine token) as its base's namespace
        assert [e.pod for e in found.endpoints] == [pod_name]
        assert idx.resolve(f"{namespace}/sql", tenant) is found
    for model in ("team-b/sql", "only-b", "team-b/only-b"):
        refused = idx.resolve(model, "a")
        assert isinstance(refused, NotFound) and refused.status == 404, model
    assert isinstance(idx.resolve("team-a/sql", "b"), NotFound)
    assert isinstance(idx.resolve("sql", None), NotFound)  # no key: shared things only
    assert isinstance(idx.resolve("team-a/nope", "a"), NotFound)
    models = dict(idx.visible_models("a"))
    assert sorted(models) == ["chat", "sql"] and idx.parent_id(models["sql"], "a") == "chat"
    base_of_b = service_view(isvc("shared", "chat", "chat"), PODS, tenant_of)
    assert idx.resolve("chat", "b") == base_of_b  # the shared base is every tenant's
    # The shared Tenant's own key reaches the base, never the tenants' adapters on it.
    assert idx.resolve("chat", "platform") == base_of_b
    assert isinstance(idx.resolve("team-a/sql", "platform"), NotFound)


def test_an_adapter_refused_a_base_it_may_not_use_is_refused_at_once() -> None:
    obj = shared_lora("team-a", "sql")
    obj["status"]["conditions"] = [
        {
            "type": "Ready",
            "status": "False",
            "reason": "BaseNotShared",
            "message": "spec.serviceNamespace ...",
        }
    ]
    route = adapter_route(adapter(obj), service_view(isvc("shared", "chat", "chat"), PODS, tenant_of))
    assert route.adapter_refusal == "spec.serviceNamespace ..."
