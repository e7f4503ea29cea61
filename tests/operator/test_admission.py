"""The admission rule and the quota ledger: charges, messages naming everything, concurrency, and the
webhook refusing what the reconciler would mark invalid, in the same words."""

from __future__ import annotations

import threading

from flotilla.operator.api.v1alpha1 import InferenceServiceSpec, TenantSpec
from flotilla.operator.config import OperatorConfig
from flotilla.operator.controllers.webhook_reviews import review_service
from flotilla.operator.desired.reconcile import World, plan
from flotilla.operator.tenancy.quota import Held
from flotilla.operator.tenancy.quota_review import charge, review
from flotilla.operator.tenancy.reservations import (
    Reservation,
    Stored,
    charges,
    claims_data,
    live,
    parse,
    pending_claims,
    serialize,
)

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


def test_a_reservation_counts_until_stored_replaced_or_expired():
    key = ("a", "x")
    mine = Reservation(Held(key, "t", "h100", 2), "uid-1", expires=100.0)
    assert live([mine], {}, now=10) == [mine]  # not stored yet
    assert live([mine], {}, now=100) == []  # expired: stored or failed by now
    stored_same = {key: Stored("uid-1", Held(key, "t", "h100", 2))}
    assert live([mine], stored_same, now=10) == []  # confirmed by the stored object
    stored_older = {key: Stored("uid-1", Held(key, "t", "h100", 1))}
    assert live([mine], stored_older, now=10) == [mine]  # an update not stored yet
    replaced = {key: Stored("uid-2", Held(key, "t", "h100", 1))}
    assert live([mine], replaced, now=10) == []  # its object was deleted and another took the name


def test_charges_take_the_larger_of_stored_and_reserved_and_both_types():
    key = ("a", "x")
    stored = {key: Stored("u", Held(key, "t", "h100", 1)), ("a", "y"): Stored("v", None)}
    grow = Reservation(Held(key, "t", "h100", 3), "u", 1e9)
    assert charges(stored, [grow]) == [Held(key, "t", "h100", 3)]
    move = Reservation(Held(key, "t", "a100", 1), "u", 1e9)
    assert charges(stored, [move]) == [Held(key, "t", "a100", 1), Held(key, "t", "h100", 1)]
    # Counted as one service for maxServices, though charged twice.
    spec_ = TenantSpec(namespaces=["a"], gpu_quota={"h100": 4, "a100": 4}, max_services=2)
    second = review(key=("a", "z"), tenant="t", tenant_spec=spec_, new=charge(spec()), old=None,
                    others=charges(stored, [move]))  # fmt: skip
    assert second.allowed


def test_reservations_survive_the_configmap_round_trip():
    held = [Reservation(Held(("ns", "svc.v2"), "t", "h100", 2), "u", 12.5),
            Reservation(Held(("ns", "b"), "t", None, 0), "", 13.0)]  # fmt: skip
    data = serialize(held)
    assert sorted(data) == ["ns.b", "ns.svc.v2"]
    assert sorted(parse("t", {**data, "ns.bad": "{not json"}), key=lambda r: r.key) == sorted(
        held, key=lambda r: r.key
    )


def test_concurrent_reviews_serialize_on_the_reservation_write():
    """Eight reviews race on one tenant's ConfigMap, written only if its version is still the one read
    (what the API server's resourceVersion check does): exactly the quota is admitted."""
    lock = threading.Lock()
    store: dict = {"version": 0, "data": {}}
    tenant = TenantSpec(namespaces=["a"], gpu_quota={"h100": 3})
    admitted, barrier = [], threading.Barrier(8)

    def admit(i: int) -> None:
        barrier.wait()
        key = ("a", f"s{i}")
        while True:
            with lock:
                version, data = store["version"], dict(store["data"])
            reservations = live(parse("t", data), {}, now=0)
            verdict = review(key=key, tenant="t", tenant_spec=tenant, new=charge(spec()), old=None,
                             others=charges({}, reservations))  # fmt: skip
            if not verdict.allowed:
                return
            new = serialize([*reservations, Reservation(Held(key, "t", "h100", 1), f"u{i}", 30)])
            with lock:
                if store["version"] == version:  # the compare-and-swap
                    store["version"], store["data"] = version + 1, new
                    admitted.append(i)
                    return

    threads = [threading.Thread(target=admit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 3


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


def test_a_tenants_claim_counts_until_it_is_stored_or_expires():
    spec = {"namespaces": ["shared"]}
    data = claims_data({"first": (spec, 30.0), "old": (spec, 5.0)})
    assert set(pending_claims(data, {}, now=10)) == {"first"}  # "old" expired
    assert pending_claims(data, {"first": spec}, now=10) == {}  # stored as admitted: no longer pending
    changed = pending_claims(data, {"first": {"namespaces": ["other"]}}, now=10)
    assert changed == {"first": (spec, 30.0)}  # an update not stored yet still claims what it asked
    assert pending_claims({"bad": "{"}, {}, now=0) == {}
