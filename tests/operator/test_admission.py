"""The admission rule and the quota ledger: charges, messages naming everything, concurrency, and the
webhook refusing what the reconciler would mark invalid, in the same words."""

from __future__ import annotations

import threading

from flotilla.operator.api.v1alpha1 import InferenceServiceSpec, TenantSpec
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.admission import review_service
from flotilla.operator.desired.reconcile import World, plan
from flotilla.operator.tenancy.admission import charge, review
from flotilla.operator.tenancy.quota import Held, Ledger

TENANT = TenantSpec(namespaces=["a"], gpu_quota={"h100": 4}, max_services=3)


def spec(**kw) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(
        {
            "model": {"uri": "file:///m"},
            "resources": {"gpus": kw.pop("gpus", 1), "gpuType": kw.pop("t", "h100")},
            **kw,
        }
    )


def test_fixed_service_is_charged_replicas_and_autoscaled_max_replicas():
    assert charge(spec(replicas=3, gpus=2)).gpus == 6
    auto = charge(spec(replicas=1, gpus=2, autoscaling={"minReplicas": 1, "maxReplicas": 4}))
    assert auto.gpus == 8 and "maxReplicas 4 x 2 h100 GPUs" in auto.how


def test_over_quota_message_names_tenant_ask_limit_and_use():
    verdict = review(
        key=("a", "new"), tenant="team-a", tenant_spec=TENANT, new=charge(spec(replicas=3)), old=None,
        others=[Held(("a", "old"), "team-a", "h100", 2)],
    )  # fmt: skip
    assert not verdict.allowed and verdict.reason == "QuotaExceeded"
    for words in (
        "tenant team-a",
        "a/new",
        "replicas 3 x 1 h100 GPUs = 3",
        "quota is 4",
        "2 are in use",
        "a/old: 2",
        "2 remain",
    ):
        assert words in verdict.message


def test_within_quota_and_updates_that_do_not_raise_the_charge_pass():
    ok = review(key=("a", "s"), tenant="team-a", tenant_spec=TENANT, new=charge(spec(replicas=2)), old=None,
                others=[Held(("a", "o"), "team-a", "h100", 2)])  # fmt: skip
    assert ok.allowed
    # Quota lowered below use: a same-size (or smaller) update still passes, even without a tenant.
    small = TenantSpec(namespaces=["a"], gpu_quota={"h100": 1})
    same = review(key=("a", "s"), tenant="team-a", tenant_spec=small, new=charge(spec(replicas=2)),
                  old=charge(spec(replicas=3)), others=[])  # fmt: skip
    assert same.allowed and same.reason == "NotRaised"
    grow = review(key=("a", "s"), tenant="team-a", tenant_spec=small, new=charge(spec(replicas=3)),
                  old=charge(spec(replicas=2)), others=[])  # fmt: skip
    assert not grow.allowed


def test_no_tenant_unknown_type_and_max_services_are_refused():
    none = review(key=("x", "s"), tenant=None, tenant_spec=None, new=charge(spec()), old=None, others=[])
    assert not none.allowed and "namespace x belongs to no tenant" in none.message
    a100 = review(
        key=("a", "s"), tenant="team-a", tenant_spec=TENANT, new=charge(spec(t="a100")), old=None, others=[]
    )
    assert not a100.allowed and "GPU type 'a100'" in a100.message and "h100 (limit 4)" in a100.message
    full = [Held(("a", f"s{i}"), "team-a", "h100", 0) for i in range(3)]
    many = review(
        key=("a", "s"), tenant="team-a", tenant_spec=TENANT, new=charge(spec()), old=None, others=full
    )
    assert not many.allowed and "maxServices is 3" in many.message


def test_reservations_count_until_the_index_catches_up_or_they_expire():
    now = [0.0]
    ledger = Ledger(ttl=30, clock=lambda: now[0])
    ledger.reserve(Held(("a", "x"), "t", "h100", 2))
    assert [h.gpus for h in _held(ledger, "t", {}, exclude=("a", "y"))] == [2]
    indexed = {("a", "x"): Held(("a", "x"), "t", "h100", 2)}
    _held(ledger, "t", indexed, exclude=("a", "y"))  # the index shows it: the reservation goes
    assert _held(ledger, "t", {}, exclude=("a", "y")) == []
    ledger.reserve(Held(("a", "z"), "t", "h100", 1))
    now[0] = 31
    assert _held(ledger, "t", {}, exclude=("a", "y")) == []


def _held(ledger: Ledger, tenant: str, indexed: dict, exclude) -> list[Held]:
    """What the webhook does each review: the index's charges, then the tenant's other services."""
    ledger.settle(indexed)
    return ledger.others(exclude, tenant)


def test_concurrent_admissions_cannot_both_pass():
    ledger, admitted = Ledger(), []
    tenant = TenantSpec(namespaces=["a"], gpu_quota={"h100": 2})
    barrier = threading.Barrier(8)

    def admit(i: int) -> None:
        barrier.wait()
        key = ("a", f"s{i}")
        with ledger.lock:
            verdict = review(key=key, tenant="t", tenant_spec=tenant, new=charge(spec()), old=None,
                             others=_held(ledger, "t", {}, exclude=key))  # fmt: skip
            if verdict.allowed:
                ledger.reserve(Held(key, "t", "h100", 1))
                admitted.append(i)

    threads = [threading.Thread(target=admit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 2


def test_the_webhook_refuses_min_over_max_with_the_reconcilers_own_message():
    raw = {"model": {"uri": "file:///m"}, "resources": {"gpus": 1, "gpuType": "h100"},
           "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}  # fmt: skip
    obj = {"metadata": {"name": "s", "namespace": "a", "uid": "u"}, "spec": raw}
    world = World(config=OperatorConfig(), now="2026-01-01T00:00:00Z", gpu_types={"h100"},
                  tenants={"team-a": TENANT}, held_by_others=[], deployment=None, path_exists=lambda _: True)  # fmt: skip
    valid = next(c for c in plan(obj, world).status["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False"

    verdict, held = review_service(key=("a", "s"), new_raw=raw, old_raw=None, tenant="team-a",
                                   tenant_spec=TENANT, others=[])  # fmt: skip
    assert not verdict.allowed and held is None and verdict.code == 422
    assert (
        verdict.message
        == valid["message"]
        == "spec.autoscaling: minReplicas (3) is greater than maxReplicas (2)"
    )
    assert verdict.reason == valid["reason"] == "InvalidReplicaRange"

    # Within quota otherwise: once fixed, the same service is admitted and charged maxReplicas.
    fixed = {**raw, "autoscaling": {"minReplicas": 1, "maxReplicas": 2}}
    verdict, held = review_service(key=("a", "s"), new_raw=fixed, old_raw=raw, tenant="team-a",
                                   tenant_spec=TENANT, others=[])  # fmt: skip
    assert verdict.allowed and held == Held(("a", "s"), "team-a", "h100", 2)


def test_an_unchanged_invalid_spec_is_not_judged_again():
    """The operator's own writes (finalizers, annotations) to a service stored before the webhook was on
    must pass, or it could never be deleted."""
    raw = {"model": {"uri": "file:///m"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}
    verdict, _ = review_service(key=("a", "s"), new_raw=raw, old_raw=dict(raw), tenant="team-a",
                                tenant_spec=TENANT, others=[])  # fmt: skip
    assert verdict.allowed
