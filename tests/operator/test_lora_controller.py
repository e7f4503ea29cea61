"""The LoRAAdapter handlers (controllers/lora_adapters.py) and the webhook's review of adapters, run without
kopf's loop or a cluster: a fake engine per pod in place of clients/engine_lora.py, plain dicts for kopf's
indexes, patch and memo."""

from __future__ import annotations

from types import SimpleNamespace

import kopf
import pytest
from kubernetes.client.exceptions import ApiException

from flotilla.contract import engine_token
from flotilla.fetch_uri import redact_uri
from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.operator.clients.quota_ledger import World
from flotilla.operator.config import OperatorConfig
from flotilla.operator.controllers import lora_adapters, webhook_reviews
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.tenancy.reservations import Reserved, parse, serialize, without

NS, BASE, NAME = "team-a", "base", "sql"
SOURCE = "file:///adapters/sql"


class FakeEngine:
    """One engine pod's adapter API: what it serves, and the answers it is told to give."""

    def __init__(self) -> None:
        self.served: dict[str, str] = {}
        self.load_code = 200
        self.unload_codes: list[int] = []  # answered in turn, then 200/404
        self.calls: list[tuple[str, str]] = []
        self.tokens: list[str | None] = []  # the internal token each load and unload carried


@pytest.fixture
def engines(monkeypatch) -> dict[str, FakeEngine]:
    by_url: dict[str, FakeEngine] = {}

    def engine(url: str) -> FakeEngine:
        return by_url.setdefault(url, FakeEngine())

    def list_models(url):
        e = engine(url)
        data = [{"id": "tiny", "root": "tiny", "parent": None}]
        data += [{"id": n, "root": p, "parent": "tiny"} for n, p in e.served.items()]
        return 200, {"object": "list", "data": data}

    def load(url, name, path, token=None):
        e = engine(url)
        e.calls.append(("load", name))
        e.tokens.append(token)
        if e.load_code != 200:
            return e.load_code, "refused"
        if name in e.served:
            return 400, "already loaded"
        e.served[name] = redact_uri(path) if "://" in path else path  # as the engine shows a fetched one
        return 200, "Success"

    def unload(url, name, token=None):
        e = engine(url)
        e.calls.append(("unload", name))
        e.tokens.append(token)
        if e.unload_codes:
            return e.unload_codes.pop(0), "in use by 1 request"
        return (200, "Success") if e.served.pop(name, None) else (404, "not loaded")

    client = lora_adapters.engine_lora
    monkeypatch.setattr(client, "list_models", list_models)
    monkeypatch.setattr(client, "load", load)
    monkeypatch.setattr(client, "unload", unload)
    return SimpleNamespace(of=engine)  # type: ignore[return-value]


def _pod(name: str, ip: str) -> dict:
    return {
        "metadata": {"name": name},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def _indexes(pods: list[dict], lora: bool = True) -> dict:
    base = {
        "spec": {
            "model": {"uri": "file:///models/tiny", "servedName": "tiny"},
            "engine": {"lora": {"enabled": lora, "adapterDir": "/adapters"}},
        }
    }
    return {"services": {(NS, BASE): [base]}, "pods": {(NS, BASE): pods}}


def _body(source: str = SOURCE, status: dict | None = None) -> dict:
    return {
        "metadata": {"namespace": NS, "name": NAME, "generation": 1},
        "spec": {"inferenceService": BASE, "source": source},
        "status": status or {},
    }


def _memo(master: str | None = None) -> SimpleNamespace:
    config = OperatorConfig(engine_token_master=master)
    return SimpleNamespace(runtime=Runtime(config=config, kube=None), admission=FakeLedger({}))  # type: ignore[arg-type]


def _round(memo, body: dict, indexes: dict) -> dict:
    patch: dict = {}
    lora_adapters.resync(body=body, patch=patch, memo=memo, **indexes)
    return patch.get("status", {})


def test_a_round_loads_into_every_ready_replica_and_a_later_one_writes_nothing(engines) -> None:
    memo, pods = _memo(), [_pod("p0", "127.7.0.1"), _pod("p1", "127.7.0.2")]
    status = _round(memo, _body(), _indexes(pods))
    assert [(r["pod"], r["phase"]) for r in status["replicas"]] == [("p0", "Loaded"), ("p1", "Loaded")]
    assert engines.of("http://127.7.0.1:8000/v1").served == {NAME: "/adapters/sql"}
    assert engines.of("http://127.7.0.2:8000/v1").served == {NAME: "/adapters/sql"}
    assert _round(memo, _body(status=status), _indexes(pods)) == {}  # converged: no call, no write
    assert engines.of("http://127.7.0.1:8000/v1").calls == [("load", NAME)]


def test_a_restarted_engine_or_a_new_replica_gets_it_again_and_a_changed_source_reloads(engines) -> None:
    memo, pods = _memo(), [_pod("p0", "127.7.0.1")]
    status = _round(memo, _body(), _indexes(pods))
    engines.of("http://127.7.0.1:8000/v1").served.clear()  # the engine restarted: it forgot the adapter
    pods.append(_pod("p1", "127.7.0.2"))  # and a replica became ready
    status = _round(memo, _body(status=status), _indexes(pods))
    assert [r["phase"] for r in status["replicas"]] == ["Loaded", "Loaded"]
    assert engines.of("http://127.7.0.1:8000/v1").calls == [("load", NAME), ("load", NAME)]
    _round(memo, _body("file:///adapters/sql-v2", status), _indexes(pods))
    assert engines.of("http://127.7.0.2:8000/v1").served == {NAME: "/adapters/sql-v2"}
    assert engines.of("http://127.7.0.2:8000/v1").calls[-2:] == [("unload", NAME), ("load", NAME)]


def test_a_presigned_archive_source_loads_once_and_its_signature_shows_nowhere(engines) -> None:
    """The engine shows a fetched adapter's URI without its query; the round compares that form, so the
    second round finds it loaded (no reload loop), and the status never carries the signature."""
    source = "https://bucket.host/sql.tar.gz?X-Amz-Signature=secret"
    memo, pods = _memo(), [_pod("p0", "127.7.0.1")]
    indexes = _indexes(pods)
    indexes["services"][(NS, BASE)][0]["spec"]["engine"]["lora"].pop("adapterDir")  # none needed
    status = _round(memo, _body(source), indexes)
    assert [(r["pod"], r["phase"]) for r in status["replicas"]] == [("p0", "Loaded")]
    assert _round(memo, _body(source, status), indexes) == {}  # converged: no call, no write
    assert engines.of("http://127.7.0.1:8000/v1").calls == [("load", NAME)]
    assert "secret" not in str(status)


def test_a_refused_load_is_failed_and_a_base_without_lora_is_not_asked(engines) -> None:
    memo = _memo()
    engines.of("http://127.7.0.1:8000/v1").load_code = 400
    status = _round(memo, _body(), _indexes([_pod("p0", "127.7.0.1")]))
    assert status["replicas"][0]["phase"] == "Failed" and "refused" in status["replicas"][0]["message"]
    engine = engines.of("http://127.7.0.9:8000/v1")
    status = _round(memo, _body(), _indexes([_pod("p9", "127.7.0.9")], lora=False))
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["reason"] == "LoRANotEnabled" and engine.calls == []


def test_delete_unloads_and_retries_while_the_adapter_is_in_use(engines) -> None:
    memo, pods = _memo(), [_pod("p0", "127.7.0.1")]
    _round(memo, _body(), _indexes(pods))
    engine = engines.of("http://127.7.0.1:8000/v1")
    engine.unload_codes = [409]
    with pytest.raises(kopf.TemporaryError, match="p0 \\(409"):
        lora_adapters.unload(body=_body(), retry=0, memo=memo, **_indexes(pods))
    assert engine.served == {NAME: "/adapters/sql"}
    lora_adapters.unload(body=_body(), retry=1, memo=memo, **_indexes(pods))
    assert engine.served == {}
    lora_adapters.unload(body=_body(), retry=0, memo=memo, **_indexes(pods))  # 404: already gone, done


# -- the webhook ------------------------------------------------------------------------------------------------
class FakeLedger:
    """clients/quota_ledger.py in memory: the world, the stored adapters, and the ConfigMap's data with a
    version, written only by a writer that read the current one (the API server's resourceVersion check)."""

    def __init__(self, tenants: dict[str, TenantSpec], stored: list[tuple[str, str]] = ()) -> None:
        self.tenants, self.stored = tenants, list(stored)
        self.data: dict[str, dict[str, str]] = {}
        self.versions: dict[str, int] = {}

    def world(self) -> World:
        return World(tenants=self.tenants, labels={NS: {}, "team-b": {}})

    def adapters(self) -> dict[tuple[str, str], str]:
        return {key: f"uid-{key[1]}" for key in self.stored}

    def read(self, tenant: str) -> tuple[Reserved, str | None]:
        version = self.versions.get(tenant)
        return parse(tenant, self.data.get(tenant)), None if version is None else str(version)

    def write(self, tenant: str, tenant_uid: str, reserved: Reserved, version: str | None) -> bool:
        current = self.versions.get(tenant)
        if (None if current is None else str(current)) != version:
            return False
        self.data[tenant], self.versions[tenant] = serialize(reserved), (current or 0) + 1
        return True

    def release(self, key: tuple[str, str], uid: str, *, adapter: bool = False) -> None:
        for tenant in list(self.data):
            reserved, version = self.read(tenant)
            self.write(tenant, "", without(reserved, key, uid, adapter=adapter), version)


def _custom(adapters: list[dict], services: dict[tuple[str, str], dict] | None = None) -> SimpleNamespace:
    """The API's custom objects as the webhook reads them: the stored adapters (a list) and services (a get;
    404 for one not stored)."""

    def get(group, version, namespace, plural, name):
        assert plural == "inferenceservices"
        if (namespace, name) not in (services or {}):
            raise ApiException(status=404, reason="Not Found")
        return (services or {})[(namespace, name)]

    return SimpleNamespace(
        list_cluster_custom_object=lambda *a: {"items": adapters}, get_namespaced_custom_object=get
    )


def _webhook_memo(
    limit: int | None, stored: list[tuple[str, str]], services: dict[tuple[str, str], dict] | None = None
) -> SimpleNamespace:
    tenants = {"acme": TenantSpec.model_validate({"namespaces": [NS], "maxLoRAAdapters": limit})}
    custom = _custom([], services)
    runtime = Runtime(config=OperatorConfig(), kube=SimpleNamespace(custom=custom))  # type: ignore[arg-type]
    return SimpleNamespace(admission=FakeLedger(tenants, stored), runtime=runtime)


def _admit(
    memo, name: str = NAME, source: str = SOURCE, old: dict | None = None, namespace: str = NS
) -> None:
    body = {"metadata": {"uid": f"uid-{name}"}, "spec": {"inferenceService": BASE, "source": source}}
    # kopf passes many more keyword arguments; the handler reads only these.
    given: dict = {"body": body, "old": old, "namespace": namespace, "name": name, "memo": memo}
    webhook_reviews.admit_adapter(**given)


def test_the_webhook_refuses_a_bad_source_and_an_adapter_past_the_tenants_limit() -> None:
    with pytest.raises(
        kopf.AdmissionError, match="spec.source: 's3://bucket/x': scheme 's3' is not supported"
    ) as refused:
        _admit(_webhook_memo(None, []), source="s3://bucket/x")
    assert refused.value.code == 422
    with pytest.raises(
        kopf.AdmissionError, match="spec.source: 'pvc://claim': a pvc uri needs a claim and a path"
    ):
        _admit(_webhook_memo(None, []), source="pvc://claim")
    _admit(_webhook_memo(None, []), source="pvc://claim/x")  # no base yet: its Ready condition will say
    _admit(_webhook_memo(None, []), source="hf://org/x@v1")  # the engine fetches these
    _admit(_webhook_memo(None, []), source="https://host/x.tar.gz")
    memo = _webhook_memo(2, [(NS, "one"), (NS, "two"), ("team-b", "other")])
    with pytest.raises(kopf.AdmissionError, match="tenant acme: .* maxLoRAAdapters is 2") as refused:
        _admit(memo)
    assert refused.value.code == 403
    _admit(memo, name="one")  # the stored one, applied again
    _admit(memo, old={"spec": {"inferenceService": BASE, "source": "file:///old"}})  # an update adds none
    _admit(memo, namespace="team-b")  # no tenant owns team-b
    _admit(_webhook_memo(3, [(NS, "one"), (NS, "two")]))


def test_the_webhook_reserves_each_admitted_create_and_a_delete_releases_it(engines) -> None:
    """Two creates reviewed before either is stored: the second counts the first's reservation. Deleting
    the first releases it (the finalizer, before the object goes), and the slot is free again."""
    memo = _webhook_memo(2, [(NS, "one")])
    _admit(memo, name="two")
    with pytest.raises(kopf.AdmissionError, match="2 are registered \\(1 of them admitted moments ago") as no:
        _admit(memo, name="three")
    assert no.value.code == 403
    _admit(memo, name="two")  # the same create again (a client's retry) is not another adapter
    body = _body()
    body["metadata"].update(name="two", uid="uid-two")
    other = _body()
    other["metadata"].update(name="two", uid="uid-other")  # another object of that name: not its reservation
    lora_adapters.unload(body=other, retry=0, memo=memo, **_indexes([]))
    with pytest.raises(kopf.AdmissionError):
        _admit(memo, name="three")
    lora_adapters.unload(body=body, retry=0, memo=memo, **_indexes([]))
    _admit(memo, name="three")
    # Seen gone (an adapter deleted before its finalizer was on): released too. kopf passes more arguments.
    gone: dict = {"event": {"type": "DELETED", "object": {"metadata": {}}}, "namespace": NS, "name": "three"}
    lora_adapters.deleted(memo=memo, **gone)
    _admit(memo, name="four")


def test_the_webhook_refuses_a_folder_source_the_stored_bases_replicas_do_not_mount() -> None:
    """A pvc source must name the base's adapterClaim, a file source lie under its adapterDir: refused (422)
    naming the field, the value and what is accepted, when the base exists and serves adapters. A base
    not stored yet, or not serving adapters yet, is left to the Ready condition (it may come later)."""
    lora = {"enabled": True, "adapterClaim": "data", "adapterDir": "/adapters"}
    base = {"spec": {"model": {"uri": "file:///models/tiny", "servedName": "tiny"}, "engine": {"lora": lora}}}
    memo = _webhook_memo(None, [], {(NS, BASE): base})
    _admit(memo, source="pvc://data/team-a/sql")
    _admit(memo, source="file:///adapters/sql")
    _admit(memo, source="https://host/sql.tar.gz")  # fetched: the base is not even read
    with pytest.raises(kopf.AdmissionError) as refused:
        _admit(memo, source="pvc://other/sql")
    assert refused.value.code == 422
    assert str(refused.value) == (
        f"LoRAAdapter {NS}/{NAME}: spec.source 'pvc://other/sql': claim 'other' is not 'data', the "
        f"spec.engine.lora.adapterClaim of InferenceService {NS}/{BASE}: its replicas mount only that claim "
        "(accepted: pvc://data/<folder>)"
    )
    with pytest.raises(kopf.AdmissionError, match="spec.source /srv/sql is not under /adapters"):
        _admit(memo, source="file:///srv/sql")
    lora.pop("adapterClaim")
    with pytest.raises(kopf.AdmissionError, match="sets no spec.engine.lora.adapterClaim"):
        _admit(memo, source="pvc://data/sql")
    lora["enabled"] = False
    _admit(memo, source="pvc://data/sql")  # LoRANotEnabled is the Ready condition's
    _admit(_webhook_memo(None, []), source="pvc://data/sql")  # no base stored


def test_a_pvc_source_loads_from_the_claims_mount_and_only_on_a_base_that_mounts_it(engines) -> None:
    memo, pods = _memo(), [_pod("p0", "127.7.0.1")]
    indexes = _indexes(pods)
    lora = indexes["services"][(NS, BASE)][0]["spec"]["engine"]["lora"]
    status = _round(memo, _body("pvc://data/sql"), indexes)
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert (
        ready["status"] == "False"
        and ready["reason"] == "NoAdapterClaim"
        and "'pvc://data/sql'" in ready["message"]
    )
    assert engines.of("http://127.7.0.1:8000/v1").calls == []  # never asked to load what it cannot see
    lora["adapterClaim"] = "data"
    status = _round(memo, _body("pvc://data/sql", status), indexes)
    assert [(r["pod"], r["phase"]) for r in status["replicas"]] == [("p0", "Loaded")]
    assert engines.of("http://127.7.0.1:8000/v1").served == {NAME: "/mnt/lora-adapters/data/sql"}
    assert _round(memo, _body("pvc://data/sql", status), indexes) == {}  # converged: no call, no write
    lora["adapterClaim"] = "other"
    status = _round(memo, _body("pvc://data/sql", status), indexes)
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["reason"] == "SourceOutsideAdapterClaim" and "pvc://other/<folder>" in ready["message"]


def test_loads_and_unloads_carry_the_namespaces_internal_token_when_engines_have_one(engines) -> None:
    """Engines with an internal token load and unload only for callers that send it (docs/lora.md)."""
    pods = [_pod("p0", "127.7.0.1")]
    status = _round(_memo("master"), _body(), _indexes(pods))
    _round(_memo("master"), _body("file:///adapters/sql-v2", status), _indexes(pods))
    engine = engines.of("http://127.7.0.1:8000/v1")
    assert engine.calls == [("load", NAME), ("unload", NAME), ("load", NAME)]
    assert engine.tokens == [engine_token("master", NS)] * 3
    _round(_memo(), _body("file:///adapters/sql-v3", status), _indexes([_pod("p5", "127.7.0.5")]))
    assert engines.of("http://127.7.0.5:8000/v1").tokens == [None]  # no master: engines have no token


# -- a base service in another namespace ---------------------------------------------------------------------
SHARED = "shared"  # the platform's shared Tenant's (spec.shared): its services are every tenant's
UNOWNED = "nobodys"  # claimed by no Tenant: nobody's, not shared
TENANTS = {
    "acme": {"namespaces": [NS, "team-a2"]},
    "beta": {"namespaces": ["team-b"]},
    "platform": {"namespaces": [SHARED], "shared": True},
}


def _shared_indexes(pods: list[dict], base_ns: str = SHARED, tenants: dict | None = None) -> dict:
    found = _indexes(pods)
    base = found["services"][(NS, BASE)]
    return {
        "services": {(base_ns, BASE): base},
        "pods": {(base_ns, BASE): pods},
        "tenants": {name: [spec] for name, spec in (tenants or TENANTS).items()},
        "namespace_labels": {ns: [{}] for ns in (NS, "team-a2", "team-b", SHARED, UNOWNED)},
    }


def _shared_body(base_ns: str = SHARED, namespace: str = NS, status: dict | None = None) -> dict:
    body = _body(status=status)
    body["metadata"]["namespace"] = namespace
    body["spec"]["serviceNamespace"] = base_ns
    return body


def test_adapters_of_two_tenants_share_a_base_in_a_shared_namespace_under_their_own_ids(engines) -> None:
    """On a shared base the engine name is `namespace/name`: two tenants' adapters of one name coexist;
    loads carry the base namespace's token (its engines' own); delete unloads that name only."""
    memo, pods = _memo("master"), [_pod("s0", "127.7.1.1")]
    status = _round(memo, _shared_body(), _shared_indexes(pods))
    other = _round(memo, _shared_body(namespace="team-b"), _shared_indexes(pods))
    engine = engines.of("http://127.7.1.1:8000/v1")
    assert engine.served == {f"{NS}/{NAME}": "/adapters/sql", f"team-b/{NAME}": "/adapters/sql"}
    assert engine.tokens == [engine_token("master", SHARED)] * 2
    assert status["servedName"] == f"{NS}/{NAME}" and other["servedName"] == f"team-b/{NAME}"
    assert [(r["pod"], r["phase"]) for r in status["replicas"]] == [("s0", "Loaded")]
    assert {c["type"]: c["status"] for c in status["conditions"]} == {"Valid": "True", "Ready": "True"}
    lora_adapters.unload(body=_shared_body(), retry=0, memo=memo, **_shared_indexes(pods))
    assert engine.served == {f"team-b/{NAME}": "/adapters/sql"}


def test_a_base_in_another_tenants_or_a_contested_namespace_is_refused_in_status_and_never_loaded(
    engines,
) -> None:
    memo, pods = _memo(), [_pod("b0", "127.7.2.1")]
    status = _round(memo, _shared_body("team-b"), _shared_indexes(pods, "team-b"))
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "BaseNotShared"
    assert ready["message"].startswith("spec.serviceNamespace 'team-b': namespace team-b does not belong to")
    assert "beta" not in ready["message"]  # never names another tenant
    assert status["replicas"] == [] and engines.of("http://127.7.2.1:8000/v1").calls == []
    contested = {**TENANTS, "gamma": {"namespaces": [SHARED]}, "delta": {"namespaces": [SHARED]}}
    status = _round(memo, _shared_body(), _shared_indexes(pods, SHARED, contested))
    assert {c["type"]: c for c in status["conditions"]}["Ready"]["reason"] == "BaseNotShared"
    # A namespace no Tenant claims is not shared: nobody's base.
    status = _round(memo, _shared_body(UNOWNED), _shared_indexes(pods, UNOWNED))
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert (
        ready["reason"] == "BaseNotShared" and f"namespace {UNOWNED} belongs to no tenant" in ready["message"]
    )
    assert "spec.shared: true" in ready["message"]  # the rule says how sharing is granted
    assert status["replicas"] == [] and engines.of("http://127.7.2.1:8000/v1").calls == []
    # Another namespace of the adapter's own tenant is its own to use.
    status = _round(memo, _shared_body("team-a2"), _shared_indexes(pods, "team-a2"))
    assert status["servedName"] == f"{NS}/{NAME}" and status["loadedReplicas"] == 1


@pytest.mark.parametrize(
    "changed",
    [
        {"platform": {"namespaces": [SHARED]}},  # the platform team revokes the sharing (spec.shared unset)
        # moved to another tenant
        {"platform": {"namespaces": []}, "beta": {"namespaces": ["team-b", SHARED]}},
        {"platform": {"namespaces": []}},  # released: claimed by no Tenant, so nobody's
    ],
)
def test_an_adapter_whose_shared_base_namespace_changes_owner_is_unloaded_there(engines, changed) -> None:
    """Admitted on a shared base, then that namespace stops being shared: the next round refuses it
    (BaseNotShared) and unloads it from the base's engines."""
    memo, pods = _memo(), [_pod("s0", "127.7.1.1")]
    status = _round(memo, _shared_body(), _shared_indexes(pods))
    engine = engines.of("http://127.7.1.1:8000/v1")
    assert engine.served == {f"{NS}/{NAME}": "/adapters/sql"}
    claimed = {**TENANTS, **changed}
    status = _round(memo, _shared_body(status=status), _shared_indexes(pods, SHARED, claimed))
    assert {c["type"]: c for c in status["conditions"]}["Ready"]["reason"] == "BaseNotShared"
    assert engine.served == {} and status["replicas"] == []
    _round(memo, _shared_body(status=status), _shared_indexes(pods, SHARED, claimed))
    assert engine.calls == [("load", f"{NS}/{NAME}"), ("unload", f"{NS}/{NAME}")]  # once: not served any more


def test_moving_an_adapter_off_a_shared_base_unloads_it_there(engines) -> None:
    memo, pods = _memo(), [_pod("s0", "127.7.1.1")]
    _round(memo, _shared_body(), _shared_indexes(pods))
    moved = _body()  # back to the base in its own namespace
    patch: dict = {}
    both = {
        **_shared_indexes(pods),
        "services": {**_shared_indexes(pods)["services"], **_indexes([])["services"]},
    }
    lora_adapters.reconcile(body=moved, old=_shared_body(), patch=patch, memo=memo, **both)
    assert engines.of("http://127.7.1.1:8000/v1").served == {}


def _sharing_memo() -> SimpleNamespace:
    tenants = {name: TenantSpec.model_validate(spec) for name, spec in TENANTS.items()}

    class Ledger(FakeLedger):
        def world(self) -> World:
            return World(
                tenants=self.tenants, labels={ns: {} for ns in (NS, "team-a2", "team-b", SHARED, UNOWNED)}
            )

    runtime = SimpleNamespace(kube=SimpleNamespace(custom=_custom([])))
    return SimpleNamespace(admission=Ledger(tenants), runtime=runtime)


def test_the_webhook_refuses_a_base_namespace_the_tenant_may_not_use() -> None:
    memo = _sharing_memo()
    read: list[tuple[str, str]] = []

    def get(group, version, namespace, plural, name):
        read.append((namespace, name))
        return {
            "spec": {
                "model": {"uri": "file:///m"},
                "engine": {"lora": {"enabled": True, "adapterDir": "/adapters"}},
            }
        }

    memo.runtime.kube.custom.get_namespaced_custom_object = get

    def admit(base_ns: str, namespace: str = NS, old: dict | None = None) -> None:
        body = {"spec": {"inferenceService": BASE, "source": SOURCE, "serviceNamespace": base_ns}}
        given: dict = {"body": body, "old": old, "namespace": namespace, "name": NAME, "memo": memo}
        webhook_reviews.admit_adapter(**given)

    admit(SHARED)  # the platform's shared Tenant's: every tenant's
    admit(SHARED, namespace="team-b")  # another tenant's adapter on the same shared base
    admit("team-a2")  # the tenant's own
    admit(NS)  # its own namespace, named
    with pytest.raises(kopf.AdmissionError) as refused:
        admit("team-b")
    assert refused.value.code == 403
    assert ("team-b", BASE) not in read  # another tenant's base is never read, so never shown
    assert str(refused.value).startswith(
        f"LoRAAdapter {NS}/{NAME}: spec.serviceNamespace 'team-b': namespace team-b does not belong to tenant acme"
    )
    with pytest.raises(kopf.AdmissionError, match="spec.serviceNamespace 'team-b'"):
        admit("team-b", old={"spec": {"inferenceService": BASE, "source": SOURCE}})  # an update moving it
    # A namespace no Tenant claims is nobody's: not a base for anyone, and its adapters use no other's base.
    with pytest.raises(kopf.AdmissionError, match=f"namespace {UNOWNED} belongs to no tenant, so nobody may"):
        admit(UNOWNED)
    assert (UNOWNED, BASE) not in read
    for base_ns in ("team-b", SHARED):
        with pytest.raises(kopf.AdmissionError, match="the adapter's namespace unowned belongs to no tenant"):
            admit(base_ns, namespace="unowned")
