"""The admission rule and the quota ledger: charges, messages naming everything, concurrency, and the
webhook refusing what the reconciler would mark invalid, in the same words."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import kopf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.operator.api.v1alpha1 import InferenceServiceSpec, TenantSpec
from flotilla.operator.clients.quota_ledger import World as AdmissionWorld
from flotilla.operator.config import OperatorConfig
from flotilla.operator.controllers import webhook_reviews
from flotilla.operator.controllers.webhook_reviews import review_service
from flotilla.operator.desired.reconcile import World, plan
from flotilla.operator.tenancy.lora_limit import adapter_limit_refusal
from flotilla.operator.tenancy.quota import Held
from flotilla.operator.tenancy.quota_review import charge, review
from flotilla.operator.tenancy.reservations import (
    AdapterReservation,
    Reservation,
    Reserved,
    Stored,
    charges,
    claims_data,
    live,
    live_adapters,
    parse,
    pending_claims,
    serialize,
    without,
)

TENANT = TenantSpec(namespaces=["a"], gpu_quota={"h100": 4}, max_services=3)
ROOTS = ("/m",)  # the host-path roots the operator allows, for the file:///m models below


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
    data = serialize(Reserved(tuple(held)))
    assert sorted(data) == ["ns.b", "ns.svc.v2"]
    assert sorted(parse("t", {**data, "ns.bad": "{not json"}).services, key=lambda r: r.key) == sorted(
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
            reservations = live(parse("t", data).services, {}, now=0)
            verdict = review(key=key, tenant="t", tenant_spec=tenant, new=charge(spec()), old=None,
                             others=charges({}, reservations))  # fmt: skip
            if not verdict.allowed:
                return
            new = serialize(Reserved((*reservations, Reservation(Held(key, "t", "h100", 1), f"u{i}", 30))))
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
    world = World(config=OperatorConfig(host_path_roots=ROOTS), now="2026-01-01T00:00:00Z", gpu_types={"h100"},
                  tenants={"team-a": TENANT}, held_by_others=[], deployment=None, path_exists=lambda _: True)  # fmt: skip
    valid = next(c for c in plan(obj, world).status["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False"

    verdict, held = review_service(key=("a", "s"), new_raw=raw, old_raw=None, tenant="team-a",
                                   tenant_spec=TENANT, others=[], host_path_roots=ROOTS)  # fmt: skip
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
                                   tenant_spec=TENANT, others=[], host_path_roots=ROOTS)  # fmt: skip
    assert verdict.allowed and held == Held(("a", "s"), "team-a", "h100", 2)


def test_an_unchanged_invalid_spec_is_not_judged_again():
    """The operator's own writes (finalizers, annotations) to a service stored before the webhook was on
    must pass, or it could never be deleted."""
    raw = {"model": {"uri": "file:///m"}, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}
    verdict, _ = review_service(key=("a", "s"), new_raw=raw, old_raw=dict(raw), tenant="team-a",
                                tenant_spec=TENANT, others=[], host_path_roots=ROOTS)  # fmt: skip
    assert verdict.allowed


def test_a_tenants_claim_counts_until_it_is_stored_or_expires():
    spec = {"namespaces": ["shared"]}
    data = claims_data({"first": (spec, 30.0), "old": (spec, 5.0)})
    assert set(pending_claims(data, {}, now=10)) == {"first"}  # "old" expired
    assert pending_claims(data, {"first": spec}, now=10) == {}  # stored as admitted: no longer pending
    changed = pending_claims(data, {"first": {"namespaces": ["other"]}}, now=10)
    assert changed == {"first": (spec, 30.0)}  # an update not stored yet still claims what it asked
    assert pending_claims({"bad": "{"}, {}, now=0) == {}


# -- LoRAAdapter reservations: maxLoRAAdapters held the way GPU quota is -------------------------------------
def test_an_adapter_reservation_counts_until_its_name_is_stored_or_it_expires():
    mine = AdapterReservation(("a", "sql"), "uid-1", expires=100.0)
    assert live_adapters([mine], [], now=10) == [mine]  # admitted, not stored yet
    assert live_adapters([mine], [], now=100) == []  # expired: stored or failed by now
    assert live_adapters([mine], [("a", "sql")], now=10) == []  # stored: it counts as stored now
    assert live_adapters([mine], [("a", "other")], now=10) == [mine]


def test_the_limit_counts_stored_and_reserved_adapters_once_each_and_says_which():
    refusal = adapter_limit_refusal(
        tenant="acme", limit=3, namespace="a", name="new", existing=[("a", "one"), ("a", "two")],
        reserved=[("a", "two"), ("a", "three")],  # "two" is stored and reserved: counted once
    )  # fmt: skip
    assert refusal is not None
    assert "tenant acme" in refusal and "a/new would be adapter number 4" in refusal
    assert "maxLoRAAdapters is 3 and 3 are registered (1 of them admitted moments ago" in refusal
    # Its own name (a create retried after a timeout) is not another adapter.
    ok = adapter_limit_refusal(tenant="acme", limit=2, namespace="a", name="new", existing=[("a", "one")],
                               reserved=[("a", "new")])  # fmt: skip
    assert ok is None


def test_both_kinds_share_one_configmap_without_colliding():
    """A namespace named `lora` holds a service `x`; an adapter reservation `lora/x` is another entry."""
    service = Reservation(Held(("lora", "x"), "t", "h100", 1), "u1", 10.0)
    adapter = AdapterReservation(("lora", "x"), "u2", 11.0)
    data = serialize(Reserved((service,), (adapter,)))
    assert sorted(data) == ["lora.x", "lora_lora.x"]
    assert parse("t", data) == Reserved((service,), (adapter,))
    # Entries nobody can read reserve nothing, of either kind.
    junk = {**data, "lora_a.b": "[]", "a.b": '{"gpus": "many", "expires": 1}', "lora_c.d": "{"}
    assert parse("t", junk) == Reserved((service,), (adapter,))


def test_a_release_drops_only_the_deleted_objects_reservation():
    old = AdapterReservation(("a", "x"), "uid-old", 50.0)
    service = Reservation(Held(("a", "x"), "t", "h100", 1), "uid-old", 50.0)
    reserved = Reserved((service,), (old,))
    assert without(reserved, ("a", "x"), "uid-old", adapter=True) == Reserved((service,), ())
    assert without(reserved, ("a", "x"), "uid-old", adapter=False) == Reserved((), (old,))
    # A new object of the same name, admitted while the old one was being deleted, keeps its own.
    assert without(reserved, ("a", "x"), "uid-new", adapter=True) == reserved
    assert without(reserved, ("a", "x"), "", adapter=True) == Reserved((service,), ())
    assert reserved.unexpired(now=50.0) == Reserved()


DNS = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
NAMES = st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,8}[a-z0-9])?", fullmatch=True)
EXPIRES = st.floats(0, 1e10, allow_nan=False).map(lambda f: round(f, 3))
SERVICES = st.builds(
    lambda ns, n, t, g, u, e: Reservation(Held((ns, n), "t", t, g), u, e),
    DNS, NAMES, st.none() | st.sampled_from(["h100", "a100"]), st.integers(0, 64), st.text("abc-0", max_size=6),
    EXPIRES,
)  # fmt: skip
ADAPTERS = st.builds(AdapterReservation, st.tuples(DNS, NAMES), st.text("abc-0", max_size=6), EXPIRES)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(SERVICES, max_size=6, unique_by=lambda r: r.key),
    st.lists(ADAPTERS, max_size=6, unique_by=lambda a: a.key),
)
def test_any_reservations_survive_the_configmap_round_trip(services, adapters):
    reserved = Reserved(tuple(services), tuple(adapters))
    back = parse("t", serialize(reserved))
    assert sorted(back.services, key=lambda r: r.key) == sorted(services, key=lambda r: r.key)
    assert sorted(back.adapters, key=lambda a: a.key) == sorted(adapters, key=lambda a: a.key)


class Interleaving:
    """Reviews, each in its own thread, that take turns at every call to the API, in the order `choose`
    picks among the threads waiting for a turn (drawn by hypothesis, or scripted): any interleaving of
    reviews answered at once by several operator replicas, the API server answering one call at a time."""

    def __init__(self, choose) -> None:
        self.choose, self.cond = choose, threading.Condition()
        self.local = threading.local()
        self.waiting: set[int] = set()
        self.alive: set[int] = set()
        self.turn: int | None = None

    def step(self) -> None:
        me = self.local.id
        with self.cond:
            self.waiting.add(me)
            self.turn = None
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == me)
            self.waiting.discard(me)

    def run(self, actors: list) -> None:
        def body(i: int, actor) -> None:
            self.local.id = i
            try:
                self.step()
                actor()
            finally:
                with self.cond:
                    self.alive.discard(i)
                    self.turn = None
                    self.cond.notify_all()

        self.alive = set(range(len(actors)))
        threads = [threading.Thread(target=body, args=(i, a), daemon=True) for i, a in enumerate(actors)]
        for t in threads:
            t.start()
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.turn is None and self.waiting >= self.alive)
                if not self.alive:
                    break
                self.turn = self.choose(sorted(self.waiting))
                self.cond.notify_all()
        for t in threads:
            t.join()


class SteppedLedger:
    """clients/quota_ledger.py against an API in memory: stored objects, and the tenant's ConfigMap written
    only with the version read (the API server's resourceVersion check). Every call is a turn."""

    def __init__(self, turns: Interleaving, tenant: TenantSpec, adapters: list) -> None:
        self.turns, self.tenant = turns, tenant
        self.stored_adapters = {key: f"uid-{key[1]}" for key in adapters}
        self.stored_services: dict = {}
        self.data: dict[str, str] = {}
        self.version = 0

    def world(self) -> AdmissionWorld:
        return AdmissionWorld(tenants={"t": self.tenant}, tenant_uids={"t": "t-uid"}, labels={"a": {}})

    def read(self, tenant: str):
        self.turns.step()
        return parse(tenant, dict(self.data)), str(self.version)

    def adapters(self) -> dict:
        self.turns.step()
        return dict(self.stored_adapters)

    def services(self) -> dict:
        self.turns.step()
        return dict(self.stored_services)

    def write(self, tenant: str, tenant_uid: str, reserved: Reserved, version: str | None) -> bool:
        self.turns.step()
        if version != str(self.version):
            return False
        self.data, self.version = serialize(reserved), self.version + 1
        return True


@settings(max_examples=200, deadline=None)
@given(
    limit=st.integers(0, 3),
    already=st.integers(0, 3),
    creates=st.integers(1, 5),
    gpu_creates=st.integers(0, 3),
    data=st.data(),
)
def test_concurrent_adapter_creates_never_pass_the_limit_in_any_interleaving(
    limit, already, creates, gpu_creates, data
):
    """M adapter creates (and some GPU service creates, which write the same ConfigMap) reviewed at once,
    each object stored by the API at any point after its review admitted it: exactly min(limit, M + stored)
    adapters are stored, never more at any moment, and each refusal names the tenant, count and limit."""
    turns = Interleaving(lambda ready: ready[data.draw(st.integers(0, len(ready) - 1))])
    ledger, refusals, peak = _race(turns, limit, already, creates, gpu_creates)
    expected = max(already, min(limit, already + creates))
    assert len(ledger.stored_adapters) == expected and peak[0] == expected
    assert len(refusals) == creates - (expected - already)
    for refusal in refusals:
        assert refusal.startswith("tenant t: LoRAAdapter a/new") and f"maxLoRAAdapters is {limit}" in refusal
    assert len(ledger.stored_services) == min(2, gpu_creates)


def test_a_review_reads_the_reservations_before_it_lists_the_stored_adapters():
    """The interleaving that passed the limit when a review listed the stored adapters first: R lists (none
    stored), Y (admitted earlier) is stored, W sees Y stored and writes the ConfigMap without Y's
    reservation, then R reads it and counts only W. Reading the ConfigMap first, R still sees Y reserved
    or W's write fails R's."""
    y, r, w = 1, 0, 2  # each turn: the review's start, then each call: read, list, write, then the store
    script = iter([y, y, y, y, r, r, y, w, w, w, w, w])
    turns = Interleaving(lambda ready: next(script, ready[0]))
    ledger, refusals, peak = _race(turns, limit=2, already=0, creates=3, gpu_creates=0)
    assert sorted(ledger.stored_adapters) == [("a", "new1"), ("a", "new2")] and peak[0] == 2
    assert refusals == [
        "tenant t: LoRAAdapter a/new0 would be adapter number 3, but maxLoRAAdapters is 2 and 2 are "
        "registered; delete one, or ask the platform team to raise the limit"
    ]


def test_each_kinds_review_keeps_the_other_kinds_reservations_and_drops_the_expired():
    """One ConfigMap, two kinds: a service review's write keeps the adapter reservations it read, and an
    adapter review's the services'; entries past their TTL go with either."""
    turns = Interleaving(lambda ready: ready[0])
    tenant = TenantSpec.model_validate({"namespaces": ["a"], "gpuQuota": {"h100": 4}, "maxLoRAAdapters": 4})
    ledger = SteppedLedger(turns, tenant, [])
    reserved = Reserved(
        (Reservation(Held(("a", "s"), "t", "h100", 1), "uid-s", 2000.0),
         Reservation(Held(("a", "gone"), "t", "h100", 1), "uid-g", 999.0)),
        (AdapterReservation(("a", "y"), "uid-y", 2000.0), AdapterReservation(("a", "old"), "uid-o", 999.0)),
    )  # fmt: skip
    ledger.data = serialize(reserved)
    raw = {"model": {"uri": "file:///m"}, "resources": {"gpus": 1, "gpuType": "h100"}}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(webhook_reviews, "time", SimpleNamespace(time=lambda: 1000.0, sleep=lambda _: None))
        admit = webhook_reviews._admit
        turns.run(
            [lambda: admit(ledger, "a", "s2", "uid-s2", raw, None, dryrun=False, host_path_roots=ROOTS)]
        )
        after_service = parse("t", ledger.data)
        turns.run([lambda: webhook_reviews._admit_adapter(ledger, ("a", "z"), "uid-z", dryrun=False)])
    assert sorted(a.key for a in after_service.adapters) == [("a", "y")]
    got = parse("t", ledger.data)
    assert sorted(r.key for r in got.services) == [("a", "s"), ("a", "s2")]
    assert sorted(a.key for a in got.adapters) == [("a", "y"), ("a", "z")]


def _race(turns: Interleaving, limit: int, already: int, creates: int, gpu_creates: int):
    """`creates` adapter creates and `gpu_creates` one-GPU service creates (quota 2) of one tenant, each
    reviewed by the webhook's own code and stored by the API once admitted, in the turns' order."""
    tenant = TenantSpec.model_validate(
        {"namespaces": ["a"], "gpuQuota": {"h100": 2}, "maxLoRAAdapters": limit}
    )
    ledger = SteppedLedger(turns, tenant, [("a", f"old{i}") for i in range(already)])
    refusals: list[str] = []
    peak = [len(ledger.stored_adapters)]

    def adapter(i: int):
        def create() -> None:
            key = ("a", f"new{i}")
            try:
                webhook_reviews._admit_adapter(ledger, key, f"uid-new{i}", dryrun=False)
            except kopf.AdmissionError as exc:
                refusals.append(str(exc))
                return
            turns.step()  # the API stores what the webhook admitted, at a moment of its own
            ledger.stored_adapters[key] = f"uid-new{i}"
            peak[0] = max(peak[0], len(ledger.stored_adapters))

        return create

    def service(i: int):
        def create() -> None:
            raw = {"model": {"uri": "file:///m"}, "resources": {"gpus": 1, "gpuType": "h100"}}
            try:
                webhook_reviews._admit(
                    ledger, "a", f"s{i}", f"uid-s{i}", raw, None, dryrun=False, host_path_roots=ROOTS
                )
            except kopf.AdmissionError:
                return
            turns.step()
            ledger.stored_services[("a", f"s{i}")] = {"metadata": {"uid": f"uid-s{i}"}, "spec": raw}

        return create

    clock = SimpleNamespace(time=lambda: 1000.0, sleep=lambda _: None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(webhook_reviews, "time", clock)
        turns.run([adapter(i) for i in range(creates)] + [service(i) for i in range(gpu_creates)])
    return ledger, refusals, peak
