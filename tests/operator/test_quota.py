"""The reconciler's quota rule: how many replicas a tenant's quota admits, and what status says."""

from __future__ import annotations

from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.operator.tenancy.quota import Held, Ledger, granted_replicas, used_gpus

TENANT = TenantSpec(namespaces=["team-a"], gpu_quota={"h100": 8})


def _decide(requested, current=0, used=0, gpus=2, gpu_type="h100", tenant="team-a", spec=TENANT):
    return granted_replicas(
        tenant=tenant,
        tenant_spec=spec,
        gpu_type=gpu_type,
        gpus_per_replica=gpus,
        requested=requested,
        current=current,
        used_by_others=used,
    )


def test_within_quota():
    d = _decide(3, used=2)
    assert (d.replicas, d.admitted, d.reason) == (3, True, "WithinQuota")


def test_over_quota_names_tenant_ask_limit_and_use():
    d = _decide(4, used=4)
    assert not d.admitted and d.reason == "QuotaExceeded"
    assert d.replicas == 2  # (8 - 4) // 2
    for words in ("tenant team-a", "4 replicas x 2 h100 GPUs = 8", "quota is 8", "use 4"):
        assert words in d.message


def test_a_lowered_quota_never_removes_running_replicas():
    d = _decide(3, current=3, used=6)
    assert d.replicas == 3 and not d.admitted


def test_no_tenant_means_no_quota():
    d = _decide(100, tenant=None, spec=None)
    assert d.admitted and d.replicas == 100 and d.reason == "NoTenant"


def test_gpu_type_outside_the_quota():
    d = _decide(1, gpu_type="l4")
    assert not d.admitted and d.replicas == 0 and "covers: h100" in d.message


def test_cpu_only_services_are_free():
    assert _decide(5, gpus=0, gpu_type=None).admitted


def test_usage_counts_one_tenant_and_type():
    held = [
        Held(("a", "x"), "a", "h100", 2),
        Held(("a", "y"), "a", "l4", 1),
        Held(("b", "z"), "b", "h100", 4),
    ]
    assert used_gpus(held, "a", "h100") == 2


def test_the_reconcilers_ledger_holds_what_each_service_runs():
    ledger = Ledger()
    ledger.hold(Held(("a", "x"), "a", "h100", 2))
    # After a restart, seeding from status never overwrites what a reconcile has already held.
    ledger.seed([Held(("a", "x"), "a", "h100", 6), Held(("a", "y"), "a", "h100", 1)])
    assert sorted(h.gpus for h in ledger.others(("a", "z"), "a")) == [1, 2]
    assert [h.key for h in ledger.others(("a", "x"))] == [("a", "y")]
    assert ledger.release(("a", "x")) == Held(("a", "x"), "a", "h100", 2)
    assert ledger.entries("a") == [Held(("a", "y"), "a", "h100", 1)] and ledger.entries("b") == []
