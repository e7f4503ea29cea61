"""The gateway's view of InferenceServices, and which service a request's model names for which tenant."""

from __future__ import annotations

from typing import Any

from flotilla.contract import ENGINE_PORT
from flotilla.gateway.core.services import (
    DEFAULT_BLOCK_SIZE,
    Ambiguous,
    Endpoint,
    ModelIndex,
    NotFound,
    ServiceView,
    may_use,
    routable,
    scales_from_zero,
    service_view,
)
from flotilla.ownership import Owner

OWNERS = {"team-a": "a", "team-a-dev": "a", "team-b": "b", "secret-lab-b": "b", "shared": "platform"}
SHARED_TENANTS = {"platform"}  # Tenants with spec.shared: their namespaces' services are every tenant's


def tenant_of(namespace: str) -> Owner:
    owner = OWNERS.get(namespace)
    return Owner(namespace, (owner,) if owner else (), shared=owner in SHARED_TENANTS)


def isvc(namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    status = spec.pop("status", {})
    return {
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"model": {"uri": "file:///m"}, **spec},
        "status": status,
    }


def pod(
    name: str, ip: str | None, ready: bool = True, deleting: bool = False, phase: str = "Running"
) -> dict:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def view(namespace: str, name: str, served: str | None = None, **spec: Any) -> ServiceView:
    if served is not None:
        spec["model"] = {"uri": "file:///m", "servedName": served}
    return service_view(isvc(namespace, name, **spec), [], tenant_of)


# -- service_view -------------------------------------------------------------------------------------------


def test_view_reads_the_fields_routing_needs() -> None:
    obj = isvc(
        "team-a",
        "chat",
        model={"uri": "hf://org/m", "servedName": "llama"},
        resources={"gpus": 2},
        engine={"blockSize": 32},
        autoscaling={"minReplicas": 0, "maxReplicas": 3},
        status={"desiredReplicas": 2},
    )
    pods = [
        pod("chat-1", "10.0.0.6"),
        pod("chat-0", "10.0.0.5"),
        pod("chat-2", "10.0.0.7", ready=False),
        pod("chat-3", "10.0.0.8", deleting=True),
        pod("chat-4", None),  # no address yet: not an endpoint
        pod("chat-5", "10.0.0.9", phase="Failed"),
    ]
    service = service_view(obj, pods, tenant_of)
    assert (service.namespace, service.name, service.key) == ("team-a", "chat", "team-a/chat")
    assert service.served_name == "llama"
    assert service.tenant == "a"
    assert (service.min_replicas, service.desired_replicas, service.gpus_per_replica) == (0, 2, 2)
    assert service.block_size == 32 and service.effective_block_size == 32
    assert service.quota_refusal is None
    assert [e.pod for e in service.endpoints] == ["chat-0", "chat-1", "chat-2", "chat-3"]
    assert service.endpoints[0] == Endpoint(f"http://10.0.0.5:{ENGINE_PORT}", "chat-0", True, False)
    assert [e.pod for e in routable(service)] == ["chat-0", "chat-1"]
    assert scales_from_zero(service)


def test_view_defaults() -> None:
    service = service_view(isvc("shared", "tiny"), [pod("p", "fd00::5")], tenant_of)
    assert service.served_name == "tiny"  # the metadata name when servedName is unset
    assert service.tenant == "platform" and service.shared  # the shared Tenant owns it, every tenant uses it
    assert service.min_replicas is None and not scales_from_zero(service)
    assert service.gpus_per_replica == 1
    assert service.block_size is None and service.effective_block_size == DEFAULT_BLOCK_SIZE == 16
    assert service.endpoints[0].url == f"http://[fd00::5]:{ENGINE_PORT}"


def test_autoscaling_min_replicas_defaults_to_one() -> None:
    service = service_view(isvc("team-a", "x", autoscaling={"maxReplicas": 2}), [], tenant_of)
    assert service.min_replicas == 1 and not scales_from_zero(service)


def test_quota_refusal_from_quota_admitted_false() -> None:
    obj = isvc(
        "team-a",
        "big",
        status={
            "desiredReplicas": 0,
            "conditions": [
                {
                    "type": "QuotaAdmitted",
                    "status": "False",
                    "reason": "OverQuota",
                    "message": "needs 8 GPUs",
                },
                {"type": "Degraded", "status": "True", "reason": "QuotaLimited", "message": "other"},
            ],
        },
    )
    assert service_view(obj, [], tenant_of).quota_refusal == "needs 8 GPUs"


def test_quota_refusal_from_degraded_only_at_zero_desired_replicas() -> None:
    conditions = [
        {"type": "QuotaAdmitted", "status": "True", "reason": "Admitted", "message": "ok"},
        {"type": "Degraded", "status": "True", "reason": "QuotaLimited", "message": "quota allows 0 of 2"},
    ]
    at_zero = isvc("team-a", "x", status={"desiredReplicas": 0, "conditions": conditions})
    at_one = isvc("team-a", "x", status={"desiredReplicas": 1, "conditions": conditions})
    assert service_view(at_zero, [], tenant_of).quota_refusal == "quota allows 0 of 2"
    assert service_view(at_one, [], tenant_of).quota_refusal is None
    unhealthy = [{"type": "Degraded", "status": "True", "reason": "PodsUnhealthy", "message": "crash"}]
    obj = isvc("team-a", "x", status={"desiredReplicas": 0, "conditions": unhealthy})
    assert service_view(obj, [], tenant_of).quota_refusal is None


# -- visibility and resolution ------------------------------------------------------------------------------


def index() -> ModelIndex:
    return ModelIndex(
        [
            view("team-a", "chat", served="llama"),
            view("team-a-dev", "chat", served="llama"),
            view("team-b", "private", served="llama"),
            view("secret-lab-b", "b-only", served="b-model"),
            view("shared", "tiny"),
            view("team-a", "solo", served="org/solo"),
            view("unowned", "orphan"),
        ]
    )


def test_may_use() -> None:
    assert may_use("a", view("team-a", "x"))
    assert not may_use("b", view("team-a", "x"))
    assert may_use("b", view("shared", "x")) and may_use(None, view("shared", "x"))
    assert may_use("platform", view("shared", "x"))
    assert not may_use(None, view("team-a", "x")) and not may_use("platform", view("team-a", "x"))
    # A namespace no Tenant claims is nobody's: sharing is granted by a shared Tenant, never implied.
    assert not any(may_use(t, view("unowned", "x")) for t in ("a", "b", "platform", None))


def test_a_service_in_an_unowned_namespace_is_not_found_for_every_tenant_and_listed_for_none() -> None:
    for tenant in ("a", "b", "platform", None):
        for model in ("orphan", "unowned/orphan"):
            assert isinstance(index().resolve(model, tenant), NotFound), (tenant, model)
        assert all(s.namespace != "unowned" for _, s in index().visible_models(tenant))


def test_namespace_slash_name_selects_that_service() -> None:
    result = index().resolve("team-a-dev/chat", "a")
    assert isinstance(result, ServiceView) and result.key == "team-a-dev/chat"


def test_bare_name_ignores_other_tenants_services_of_the_same_name() -> None:
    result = index().resolve("llama", "b")
    assert isinstance(result, ServiceView) and result.key == "team-b/private"


def test_ambiguous_lists_only_the_callers_candidates() -> None:
    result = index().resolve("llama", "a")
    assert isinstance(result, Ambiguous) and result.status == 400
    assert result.candidates == ("team-a-dev/chat", "team-a/chat")
    assert "namespace/name" in result.message and "team-a/chat" in result.message
    assert "team-b" not in result.message and "private" not in result.message


def test_another_tenants_service_is_not_found_as_a_name_nobody_has() -> None:
    for model in ("b-model", "secret-lab-b/b-only"):
        result = index().resolve(model, "a")
        assert isinstance(result, NotFound) and result.status == 404
        # Only what the client sent: not the owner, its namespaces or its other services.
        assert result.message == f"the model {model!r} does not exist"
    bare = index().resolve("b-model", "a")
    assert isinstance(bare, NotFound)
    assert not any(leak in bare.message for leak in ("secret-lab", "team-b", "b-only", "private"))


def test_unknown_model_is_not_found() -> None:
    for model in ("nope", "team-a/nope", "nowhere/chat"):
        result = index().resolve(model, "a")
        assert isinstance(result, NotFound) and result.status == 404
        assert repr(model) in result.message


def test_shared_service_is_usable_by_every_tenant_and_anonymous() -> None:
    for tenant in ("a", "b", None):
        result = index().resolve("tiny", tenant)
        assert isinstance(result, ServiceView) and result.key == "shared/tiny"


def test_served_name_with_a_slash_resolves() -> None:
    result = index().resolve("org/solo", "a")
    assert isinstance(result, ServiceView) and result.key == "team-a/solo"


def test_visible_models_use_ids_that_resolve_for_the_caller() -> None:
    idx = index()
    models = idx.visible_models("a")
    assert [(model_id, s.key) for model_id, s in models] == [
        ("org/solo", "team-a/solo"),
        ("team-a-dev/chat", "team-a-dev/chat"),
        ("team-a/chat", "team-a/chat"),
        ("tiny", "shared/tiny"),
    ]
    for model_id, service in models:
        assert idx.resolve(model_id, "a") is service
    assert [model_id for model_id, _ in idx.visible_models("b")] == ["b-model", "llama", "tiny"]
    assert [model_id for model_id, _ in idx.visible_models(None)] == ["tiny"]
