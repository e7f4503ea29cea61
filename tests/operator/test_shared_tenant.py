"""Sharing that the platform grants: a Tenant with `spec.shared: true` (docs/tenancy.md, "Who owns a
namespace"). Its namespaces' services are open to every tenant's key and may be the base of any tenant's
LoRAAdapter; their GPUs are admitted against and metered to that Tenant's quota. A namespace no Tenant
claims is nobody's: the webhook refuses services there (saying how to share one), no key reaches them.

Each part is attacked through the code that decides it: the webhook's review (`_admit`), the gateway's
fleet (its Tenant and namespace watches) and resolver, the LoRAAdapter rule the webhook and the operator's
round share, and one metering round of the operator (`controllers.metering._meter`).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, cast

import kopf
import pytest

from flotilla import timestamps
from flotilla.gateway.core.services import NotFound, ServiceView, may_use
from flotilla.gateway.fleet import KubeFleet
from flotilla.gateway.kube import Kube as GatewayKube
from flotilla.operator.api.v1alpha1 import TenantSpec, TokenCount
from flotilla.operator.clients.quota_ledger import World
from flotilla.operator.clients.token_scrape import PodTokens
from flotilla.operator.config import OperatorConfig
from flotilla.operator.controllers import metering as metering_controller
from flotilla.operator.controllers import webhook_reviews
from flotilla.operator.controllers.state import MeteringState
from flotilla.operator.desired.lora_adapter import sharing_problem
from flotilla.operator.tenancy.reservations import parse, serialize
from flotilla.operator.tenancy.rules import owner_of

SHARED_NS, UNOWNED_NS = "shared-models", "nobodys"
TENANTS: dict[str, dict] = {
    "platform": {"namespaces": [SHARED_NS], "shared": True, "gpuQuota": {"h100": 2},
                 "pricePerGPUHour": {"h100": 3.0}},
    "team-a": {"namespaces": ["a1"], "gpuQuota": {"h100": 4}},
    "team-b": {"namespaces": ["b1"], "gpuQuota": {"h100": 4}},
}  # fmt: skip
LABELS: dict[str, dict[str, str]] = {ns: {} for ns in (SHARED_NS, UNOWNED_NS, "a1", "b1")}


def _specs() -> dict[str, TenantSpec]:
    return {name: TenantSpec.model_validate(spec) for name, spec in TENANTS.items()}


def test_the_shared_flag_is_a_tenant_field_off_by_default():
    assert TenantSpec().shared is False
    assert TenantSpec.model_validate({"shared": True}).to_wire()["shared"] is True
    assert owner_of(SHARED_NS, _specs(), LABELS).shared
    assert not owner_of("a1", _specs(), LABELS).shared and not owner_of(UNOWNED_NS, _specs(), LABELS).shared


# -- admission ---------------------------------------------------------------------------------------------


class MemoryLedger:
    """The webhook's ledger with the Tenants, the stored services and each tenant's reservations ConfigMap
    in memory (the real one is attacked on the cluster by e2e/test_admission_ha.py)."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, str]] = {}
        self.stored: dict = {}

    def world(self) -> World:
        return World(tenants=_specs(), tenant_uids={n: f"uid-{n}" for n in TENANTS}, labels=LABELS)

    def services(self) -> dict:
        return dict(self.stored)

    def read(self, tenant: str):
        return parse(tenant, self.data.get(tenant)), str(len(self.data.get(tenant) or {}))

    def write(self, tenant: str, tenant_uid: str, reserved, version) -> bool:
        self.data[tenant] = serialize(reserved)
        return True


def _admit(ledger: MemoryLedger, namespace: str, name: str, gpus: int) -> None:
    body = {
        "metadata": {"namespace": namespace, "name": name, "uid": f"uid-{name}"},
        "spec": {
            "model": {"uri": "hf://org/tiny"},
            "resources": {"gpus": gpus, "gpuType": "h100"},
            "replicas": 1,
        },
    }
    memo = SimpleNamespace(admission=ledger, runtime=SimpleNamespace(config=OperatorConfig()))
    webhook_reviews.admit_service(body=body, old=None, namespace=namespace, name=name, dryrun=False,
                                  memo=cast(kopf.Memo, memo))  # fmt: skip


def test_the_webhook_admits_a_service_in_the_shared_tenants_namespace_against_its_quota():
    ledger = MemoryLedger()
    _admit(ledger, SHARED_NS, "base", gpus=2)
    # Charged to the shared Tenant: its reservation, in its ConfigMap; no other tenant's.
    (reservation,) = parse("platform", ledger.data["platform"]).services
    assert reservation.held.tenant == "platform" and reservation.held.gpus == 2
    assert set(ledger.data) == {"platform"}
    # Its quota (2) holds: a third GPU is refused, naming the shared Tenant and its quota.
    with pytest.raises(kopf.AdmissionError) as refused:
        _admit(ledger, SHARED_NS, "another", gpus=1)
    assert refused.value.code == 403
    message = str(refused.value)
    assert "tenant platform" in message and "quota is 2" in message and f"{SHARED_NS}/base: 2" in message
    # Other tenants' quotas are their own: team-a still has its 4.
    _admit(ledger, "a1", "chat", gpus=4)


@pytest.mark.parametrize("gpus", [0, 1])
def test_the_webhook_refuses_a_service_in_an_unclaimed_namespace_and_says_how_to_share(gpus: int):
    with pytest.raises(kopf.AdmissionError) as refused:
        _admit(MemoryLedger(), UNOWNED_NS, "orphan", gpus=gpus)
    message = str(refused.value)
    assert refused.value.code == 403
    assert message.startswith(
        f"namespace {UNOWNED_NS} belongs to no tenant: InferenceService {UNOWNED_NS}/orphan"
    )
    assert "add the namespace to a Tenant" in message and "shared Tenant (spec.shared: true)" in message


# -- the gateway -------------------------------------------------------------------------------------------


def _fleet() -> KubeFleet:
    fleet = KubeFleet(cast(GatewayKube, None), "flotilla-system")
    fleet.tenants.update({n: {"metadata": {"name": n}, "spec": spec} for n, spec in TENANTS.items()})
    fleet.namespaces.update(
        {ns: {"metadata": {"name": ns, "labels": labels}} for ns, labels in LABELS.items()}
    )
    spec = {"model": {"uri": "file:///m"}, "resources": {"gpus": 1, "gpuType": "h100"}}
    for ns, name in ((SHARED_NS, "base"), ("a1", "a-only"), ("b1", "b-only"), (UNOWNED_NS, "orphan")):
        fleet.services[(ns, name)] = {"metadata": {"namespace": ns, "name": name}, "spec": spec}
    fleet._rebuild()  # noqa: SLF001 (what every watch event runs)
    return fleet


def test_every_tenants_key_uses_a_shared_service_and_none_uses_another_tenants():
    index = _fleet().index
    for tenant in ("team-a", "team-b", "platform"):
        found = index.resolve("base", tenant)
        assert isinstance(found, ServiceView) and found.key == f"{SHARED_NS}/base" and found.shared, tenant
        assert "base" in dict(index.visible_models(tenant))
    for tenant, theirs in (("team-a", "b-only"), ("team-b", "a-only"), ("platform", "a-only")):
        assert isinstance(index.resolve(theirs, tenant), NotFound), (tenant, theirs)
    # Unclaimed is not shared: no key reaches it, none lists it.
    for tenant in ("team-a", "team-b", "platform", None):
        assert isinstance(index.resolve(f"{UNOWNED_NS}/orphan", tenant), NotFound)
        assert "orphan" not in dict(index.visible_models(tenant))
    orphan = index.get(f"{UNOWNED_NS}/orphan")
    assert orphan is not None and not orphan.shared and not may_use("team-a", orphan)


# -- LoRA adapters -----------------------------------------------------------------------------------------


def test_adapters_of_two_tenants_may_name_a_base_in_the_shared_namespace_only():
    specs = _specs()
    shared = owner_of(SHARED_NS, specs, LABELS)
    for ns in ("a1", "b1"):
        assert sharing_problem(owner_of(ns, specs, LABELS), shared) is None, ns
    refused = sharing_problem(owner_of("a1", specs, LABELS), owner_of("b1", specs, LABELS))
    assert refused is not None and refused[0] == "BaseNotShared" and "team-b" not in refused[1]
    unowned = sharing_problem(owner_of("a1", specs, LABELS), owner_of(UNOWNED_NS, specs, LABELS))
    assert unowned is not None and f"namespace {UNOWNED_NS} belongs to no tenant" in unowned[1]


# -- metering ----------------------------------------------------------------------------------------------


def _pod(namespace: str, uid: str, gpus: int, started: float) -> dict[str, Any]:
    scheduled = timestamps.from_epoch(started)
    return {
        "metadata": {"uid": uid, "name": uid, "namespace": namespace,
                     "labels": {"flotilla.dev/inferenceservice": "base"}, "finalizers": []},
        "spec": {"nodeSelector": {"flotilla.dev/gpu-type": "h100"},
                 "containers": [{"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
        "status": {"phase": "Running", "podIP": "10.0.0.1",
                   "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled},
                                  {"type": "Ready", "status": "True", "lastTransitionTime": scheduled}]},
    }  # fmt: skip


class Tenants:
    """The Tenants' API as the metering round reads and writes it."""

    def __init__(self) -> None:
        self.written: dict[str, dict] = {}

    def get_cluster_custom_object(self, group, version, plural, name):
        return {"apiVersion": "flotilla.dev/v1alpha1", "kind": "Tenant",
                "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "1", "generation": 1},
                "spec": TENANTS[name], "status": {}}  # fmt: skip

    def replace_cluster_custom_object_status(self, group, version, plural, name, body):
        self.written[name] = body["status"]


def test_metering_charges_the_shared_services_gpu_time_to_the_shared_tenant(monkeypatch):
    """One round per Tenant over the same pods: the shared base's GPU time is the shared Tenant's (and
    priced at its price), never nobody's; tokens its engine served for team-a's adapter count for team-a
    only; a GPU pod in an unclaimed namespace is in no Tenant's usage."""
    started = time.time() - 3600
    pods = {
        SHARED_NS: [_pod(SHARED_NS, "shared-0", 2, started)],
        "a1": [_pod("a1", "a-0", 1, started)],
        UNOWNED_NS: [_pod(UNOWNED_NS, "orphan-0", 1, started)],
    }
    counters = {
        "shared-0": PodTokens(TokenCount(input=100, output=50), {"a1/fr": TokenCount(input=30, output=10)}),
        "a-0": PodTokens(TokenCount(input=5, output=5)),
        "orphan-0": PodTokens(TokenCount(input=7, output=7)),
    }
    monkeypatch.setattr(metering_controller, "read_token_counters",
                        lambda ps: {p["metadata"]["uid"]: counters[p["metadata"]["uid"]] for p in ps})  # fmt: skip
    monkeypatch.setattr(metering_controller.backstop, "limits", lambda *_: {})
    monkeypatch.setattr(metering_controller.backstop, "raise_limits", lambda *_: None)
    monkeypatch.setattr(metering_controller, "sync_objects", lambda *_: None)
    api = Tenants()
    rt = SimpleNamespace(kube=SimpleNamespace(custom=api))
    kwargs = {
        "tenants": {name: [spec] for name, spec in TENANTS.items()},
        "namespace_labels": {ns: [labels] for ns, labels in LABELS.items()},
        "gpu_pods": pods,
        "gpu_nodes": {},
        "services": {(SHARED_NS, "base"): {}, ("a1", "base"): {}, (UNOWNED_NS, "base"): {}},
        "lora_adapter_names": {"a1": ["fr"]},
    }
    for name in TENANTS:
        metering_controller._meter(cast(Any, rt), MeteringState(), name, kwargs)  # noqa: SLF001

    platform, team_a, team_b = (api.written[n] for n in ("platform", "team-a", "team-b"))
    by_namespace = platform["usage"]["total"]["byNamespace"]
    assert set(by_namespace) == {SHARED_NS} and by_namespace[SHARED_NS] == pytest.approx(2 * 3600, rel=0.01)
    assert platform["gpusAllocated"] == {"h100": 2} and platform["services"] == 1
    assert platform["cost"] == pytest.approx(2 * 3.0, rel=0.01)  # 2 GPU-hours at the platform's price
    assert set(team_a["usage"]["total"]["byNamespace"]) == {"a1"}
    assert not team_b["usage"]["total"].get("byNamespace")
    assert all(UNOWNED_NS not in s["usage"]["total"].get("byNamespace", {}) for s in api.written.values())
    # Tokens count once: team-a's adapter's on the shared engine are team-a's, the rest the platform's.
    assert platform["tokens"] == {"input": 70, "output": 40}
    assert team_a["tokens"] == {"input": 35, "output": 15}
    assert team_a["adapters"]["a1/fr"]["input"] == 30 and "a1/fr" not in (platform.get("adapters") or {})
