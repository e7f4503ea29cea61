"""Which Tenant owns a namespace, and which namespaces are shared: every consumer of the rule against one
table, and no second copy of it.

The operator's admission, reconcile (quota and the engine's tenant), RBAC/ResourceQuota and metering, and
the gateway's model lists and routing all ask flotilla.ownership. Each is run here against the same
Tenants and namespaces; a consumer that reads `spec.namespaces`, a selector or `spec.shared` itself
disagrees with the table on the label-claimed or shared rows (as the gateway once did), and the source
scan below fails on the copy. Sharing is granted by a Tenant marked `spec.shared`, never implied by a
missing claim: an unclaimed namespace is nobody's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import cast

import pytest

from flotilla.gateway.core.services import may_use
from flotilla.gateway.fleet import KubeFleet
from flotilla.gateway.kube import Kube as GatewayKube
from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.operator.clients.quota_ledger import World as AdmissionWorld
from flotilla.operator.config import OperatorConfig
from flotilla.operator.controllers.webhook_reviews import _stored
from flotilla.operator.desired.reconcile import World, plan
from flotilla.operator.naming import NO_TENANT
from flotilla.operator.tenancy.rules import namespaces_owned, tenant_of
from flotilla.operator.tenancy.rules import owner_of as operator_owner_of
from flotilla.ownership import owner_of

TENANTS: dict[str, dict] = {
    "by-name": {"namespaces": ["n-listed", "n-not-yet", "n-both"], "gpuQuota": {"h100": 4}},
    "by-labels": {"namespaceSelector": {"matchLabels": {"team": "lab"}}, "gpuQuota": {"h100": 4}},
    "by-expressions": {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["gold", "silver"]},
                {"key": "frozen", "operator": "DoesNotExist"},
                {"key": "env", "operator": "NotIn", "values": ["prod"]},
            ]
        },
        "gpuQuota": {"h100": 4},
    },
    "label-and-name": {
        "namespaces": ["n-pair"],
        "namespaceSelector": {
            "matchLabels": {"team": "pair"},
            "matchExpressions": [{"key": "owner", "operator": "Exists"}],
        },
        "gpuQuota": {"h100": 4},
    },
    "empty-selector": {"namespaceSelector": {}, "gpuQuota": {"h100": 4}},
    # The platform's shared Tenant: its namespaces' services are every tenant's, its quota pays for them.
    "platform": {
        "namespaces": ["n-shared"],
        "namespaceSelector": {"matchLabels": {"share": "yes"}},
        "shared": True,
        "gpuQuota": {"h100": 8},
    },
}
SHARED_TENANTS = {"platform"}

NAMESPACES: dict[str, dict[str, str]] = {
    "n-listed": {},
    "n-labelled": {"team": "lab"},
    "n-gold": {"tier": "gold"},
    "n-gold-frozen": {"tier": "gold", "frozen": "yes"},
    "n-gold-prod": {"tier": "gold", "env": "prod"},
    "n-bronze": {"tier": "bronze"},
    "n-pair": {},
    "n-pair-labelled": {"team": "pair", "owner": "x"},
    "n-pair-no-owner": {"team": "pair"},
    "n-both": {"team": "lab"},  # listed by by-name and selected by by-labels: contested
    "n-free": {"team": "nobody"},
    "n-shared": {},
    "n-shared-labelled": {"share": "yes"},
    "n-shared-contested": {"share": "yes", "team": "lab"},  # the shared Tenant's and by-labels': nobody's
}

# namespace -> the owning Tenant, None (nobody), or a tuple of the Tenants contesting it.
EXPECTED: dict[str, str | None | tuple[str, ...]] = {
    "n-listed": "by-name",
    "n-not-yet": "by-name",  # listed but not created yet
    "n-labelled": "by-labels",
    "n-gold": "by-expressions",
    "n-gold-frozen": None,
    "n-gold-prod": None,
    "n-bronze": None,
    "n-pair": "label-and-name",
    "n-pair-labelled": "label-and-name",
    "n-pair-no-owner": None,
    "n-both": ("by-labels", "by-name"),
    "n-free": None,  # unowned: nobody's, not shared
    "n-shared": "platform",
    "n-shared-labelled": "platform",
    "n-shared-contested": ("by-labels", "platform"),  # contested: never shared
}


def _owner(expected) -> str | None:
    return expected if isinstance(expected, str) else None


def _shared(expected) -> bool:
    return _owner(expected) in SHARED_TENANTS


def _specs() -> dict[str, TenantSpec]:
    return {name: TenantSpec.model_validate(spec) for name, spec in TENANTS.items()}


@pytest.mark.parametrize("namespace", sorted(EXPECTED))
def test_the_rule(namespace: str):
    owner = owner_of(namespace, TENANTS, NAMESPACES)
    expected = EXPECTED[namespace]
    assert owner.tenant == _owner(expected)
    assert owner.contested == isinstance(expected, tuple)
    assert owner.shared == _shared(expected)
    if isinstance(expected, tuple):
        assert owner.claimants == expected


@pytest.mark.parametrize("namespace", sorted(EXPECTED))
def test_the_operators_models_agree(namespace: str):
    assert tenant_of(namespace, _specs(), NAMESPACES) == _owner(EXPECTED[namespace])
    # The pydantic model keeps spec.shared, so the operator's answer is the table's.
    assert operator_owner_of(namespace, _specs(), NAMESPACES).shared == _shared(EXPECTED[namespace])


def test_rbac_quota_and_metering_cover_exactly_the_owned_namespaces():
    """tenant_access and metering act on namespaces_owned: a contested namespace is neither tenant's."""
    for tenant in TENANTS:
        owned = set(namespaces_owned(tenant, _specs(), NAMESPACES))
        assert owned == {ns for ns, e in EXPECTED.items() if e == tenant}, tenant


def test_the_webhook_charges_each_tenant_for_its_own_namespaces():
    world = AdmissionWorld(tenants=_specs(), labels=NAMESPACES)
    services = {(ns, "svc"): {"metadata": {"uid": ns}, "spec": _isvc_spec()} for ns in EXPECTED}
    for tenant in TENANTS:
        charged = {key[0] for key in _stored(world, tenant, services)}
        assert charged == {ns for ns, e in EXPECTED.items() if e == tenant}, tenant


@pytest.mark.parametrize("namespace", sorted(EXPECTED))
def test_the_reconciler_charges_and_labels_the_owner(namespace: str):
    obj = {"metadata": {"name": "svc", "namespace": namespace, "uid": "u"}, "spec": _isvc_spec()}
    world = World(config=OperatorConfig(host_path_roots=("/m",)), now="2026-01-01T00:00:00Z",
                  gpu_types={"h100"}, tenants=_specs(), namespace_labels=NAMESPACES, held_by_others=[],
                  deployment=None, path_exists=lambda _: True)  # fmt: skip
    result = plan(obj, world)
    expected = EXPECTED[namespace]
    assert result.held is not None
    assert result.held.tenant == (_owner(expected) or NO_TENANT)
    admitted = next(c for c in result.status["conditions"] if c["type"] == "QuotaAdmitted")
    if isinstance(expected, tuple):
        # Nobody's quota grants GPUs in a contested namespace: the service gets no new replica.
        assert admitted["status"] == "False" and admitted["reason"] == "NamespaceContested"
        assert all(t in admitted["message"] for t in expected)
        assert result.held.gpus == 0


def test_the_gateway_serves_each_namespace_to_its_owner_only():
    fleet = KubeFleet(cast(GatewayKube, None), "flotilla-system")
    fleet.tenants.update({name: {"metadata": {"name": name}, "spec": spec} for name, spec in TENANTS.items()})
    fleet.namespaces.update(
        {ns: {"metadata": {"name": ns, "labels": labels}} for ns, labels in NAMESPACES.items()}
    )
    for ns in EXPECTED:
        fleet.services[(ns, "svc")] = {"metadata": {"namespace": ns, "name": "svc"}, "spec": _isvc_spec()}
    fleet._rebuild()  # noqa: SLF001 (what every watch event runs)
    for ns, expected in EXPECTED.items():
        view = fleet.index.get(f"{ns}/svc")
        assert view is not None
        assert view.tenant == _owner(expected), ns
        assert view.shared == _shared(expected), ns
        for tenant in [*TENANTS, "stranger", None]:
            if _shared(expected):
                allowed = True  # the shared Tenant's: every tenant's
            elif expected is None or isinstance(expected, tuple):
                allowed = False  # unowned or contested: nobody's
            else:
                allowed = tenant == expected
            assert may_use(tenant, view) == allowed, (ns, tenant)


def test_an_adapter_may_use_a_base_in_its_own_namespace_a_shared_one_or_its_tenants_own():
    """The operator's rule for a LoRAAdapter's base in another namespace is the gateway's may_use, asked
    for the adapter's tenant: every pair of namespaces of the table. An adapter of every tenant may use a
    base in the shared Tenant's namespaces; an unowned namespace is nobody's base, and an adapter in one
    uses no other namespace's."""
    from flotilla.operator.desired.lora_adapter import sharing_problem
    from flotilla.ownership import adapter_may_use

    for mine, mine_expected in EXPECTED.items():
        adapter = owner_of(mine, TENANTS, NAMESPACES)
        for theirs, expected in EXPECTED.items():
            base = owner_of(theirs, TENANTS, NAMESPACES)
            if mine == theirs:
                allowed = True
            elif not isinstance(mine_expected, str):
                allowed = False  # the adapter's namespace has no tenant (unowned or contested)
            elif isinstance(expected, tuple) or expected is None:
                allowed = False  # a contested or unowned namespace's services are nobody's
            else:
                allowed = _shared(expected) or expected == mine_expected
            assert adapter_may_use(adapter, base) == allowed, (mine, theirs)
            assert (sharing_problem(adapter, base) is None) == allowed, (mine, theirs)


def test_a_relabelled_namespace_changes_owner_in_the_gateway_at_the_next_event():
    fleet = KubeFleet(cast(GatewayKube, None), "flotilla-system")
    for name in ("by-labels", "platform"):
        fleet.tenants[name] = {"metadata": {"name": name}, "spec": TENANTS[name]}
    fleet.services[("n-x", "svc")] = {"metadata": {"namespace": "n-x", "name": "svc"}, "spec": _isvc_spec()}
    handle = fleet._handler("namespaces", fleet.namespaces, 99)  # noqa: SLF001
    handle(("ADDED", {"metadata": {"name": "n-x", "labels": {}}}))
    unclaimed = fleet.index.get("n-x/svc")
    assert unclaimed is not None and unclaimed.tenant is None and not unclaimed.shared
    assert not may_use("stranger", unclaimed) and not may_use("by-labels", unclaimed)  # nobody's
    handle(("MODIFIED", {"metadata": {"name": "n-x", "labels": {"share": "yes"}}}))
    shared = fleet.index.get("n-x/svc")
    assert shared is not None and shared.tenant == "platform" and shared.shared
    assert may_use("stranger", shared) and may_use("by-labels", shared)  # granted: every tenant's
    handle(("MODIFIED", {"metadata": {"name": "n-x", "labels": {"team": "lab"}}}))
    view = fleet.index.get("n-x/svc")
    assert (
        view is not None
        and view.tenant == "by-labels"
        and not view.shared
        and not may_use("stranger", view)
        and may_use("by-labels", view)
    )


def _isvc_spec() -> dict:
    return {"model": {"uri": "file:///m"}, "resources": {"gpus": 1, "gpuType": "h100"}, "replicas": 1}


ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "operator" / "src", ROOT / "gateway" / "src", ROOT / "engine" / "src", ROOT / "src"]
# Reading a Tenant's claim fields, or its spec.shared, anywhere but flotilla.ownership is a second copy of
# the rule ("claimed by none" was once taken for "shared": Owner.shared is the only answer).
CLAIM_READS = re.compile(
    r"""\.namespace_selector\b|\.match_labels\b|\.match_expressions\b|\bspec\.shared\b(?!: true)|"""
    r"""(?<=[\w\)\]])\[["'](namespaces|namespaceSelector|matchLabels|matchExpressions|shared)["']\](?!\s*=)|"""
    r"""\.get\(["'](namespaces|namespaceSelector|matchLabels|matchExpressions|shared)["']"""
)


def test_no_second_copy_of_the_rule():
    found = []
    for top in SOURCES:
        for path in top.rglob("*.py"):
            if path.name == "ownership.py" and path.parent.name == "flotilla":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if CLAIM_READS.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "read a Tenant's claim only through flotilla.ownership:\n" + "\n".join(found)
