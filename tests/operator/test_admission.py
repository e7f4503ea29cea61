"""The admission rule and its ledger: charges, messages naming everything, concurrency."""

from __future__ import annotations

import threading

from flotilla.operator.api.v1alpha1 import InferenceServiceSpec, TenantSpec
from flotilla.operator.tenancy.admission import Held, Ledger, charge, review

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
        others=[Held(("a", "old"), "h100", 2)],
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
                others=[Held(("a", "o"), "h100", 2)])  # fmt: skip
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
    full = [Held(("a", f"s{i}"), "h100", 0) for i in range(3)]
    many = review(
        key=("a", "s"), tenant="team-a", tenant_spec=TENANT, new=charge(spec()), old=None, others=full
    )
    assert not many.allowed and "maxServices is 3" in many.message


def test_reservations_count_until_the_index_catches_up_or_they_expire():
    now = [0.0]
    ledger = Ledger(ttl=30, clock=lambda: now[0])
    ledger.reserve("t", Held(("a", "x"), "h100", 2))
    assert [h.gpus for h in ledger.held("t", {}, exclude=("a", "y"))] == [2]
    indexed = {("a", "x"): ("t", Held(("a", "x"), "h100", 2))}
    ledger.held("t", indexed, exclude=("a", "y"))  # the index shows it: the reservation goes
    assert ledger.held("t", {}, exclude=("a", "y")) == []
    ledger.reserve("t", Held(("a", "z"), "h100", 1))
    now[0] = 31
    assert ledger.held("t", {}, exclude=("a", "y")) == []


def test_concurrent_admissions_cannot_both_pass():
    ledger, admitted = Ledger(), []
    tenant = TenantSpec(namespaces=["a"], gpu_quota={"h100": 2})
    barrier = threading.Barrier(8)

    def admit(i: int) -> None:
        barrier.wait()
        key = ("a", f"s{i}")
        with ledger.lock():
            verdict = review(key=key, tenant="t", tenant_spec=tenant, new=charge(spec()), old=None,
                             others=ledger.held("t", {}, exclude=key))  # fmt: skip
            if verdict.allowed:
                ledger.reserve("t", Held(key, "h100", 1))
                admitted.append(i)

    threads = [threading.Thread(target=admit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 2
