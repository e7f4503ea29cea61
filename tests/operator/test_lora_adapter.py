"""LoRAAdapters: the pure decisions (desired/lora_adapter.py), the Tenant's limit (tenancy/lora_limit.py),
spec.engine.lora's rules and flags, and one controller round against a fake engine (no cluster)."""

from __future__ import annotations

import pytest

from flotilla.contract import FLAG_ENABLE_LORA, FLAG_MAX_CPU_LORAS, FLAG_MAX_LORA_RANK, FLAG_MAX_LORAS
from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.operator.desired import lora_adapter as d
from flotilla.operator.desired.validation import validate
from flotilla.operator.desired.workload import engine_flags
from flotilla.operator.tenancy.lora_limit import adapter_limit_refusal

NOW = "2026-12-05T07:00:00Z"
LATER = "2026-12-05T07:05:00Z"


# -- the source ---------------------------------------------------------------------------------------------
def test_a_file_source_is_its_normalized_absolute_path() -> None:
    assert d.adapter_path("file:///adapters/sql/") == "/adapters/sql"
    assert d.adapter_path("file:///a/./b//c") == "/a/b/c"


SHA = "ab" * 32


@pytest.mark.parametrize(
    "source",
    [
        "hf://org/adapter",
        "hf://org/adapter@v1.0",
        "https://host/adapters/sql.tar.gz",
        f"http://host:8080/sql.tgz#sha256={SHA}",
        "https://bucket.host/sql.tar?X-Amz-Signature=secret",
    ],
)
def test_hub_and_archive_sources_go_to_the_engine_as_written(source) -> None:
    """The engine fetches them itself (lora/source.py); the operator checks them with the same parser."""
    assert d.adapter_path(source) == source and d.is_fetched(source)
    assert not d.is_fetched(d.adapter_path("file:///adapters/sql"))


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("pvc://claim", "a pvc uri needs a claim and a path"),
        ("pvc://claim/../sql", "path '/../sql' leaves the claim"),
        ("pvc://Claim_1/sql", "claim 'Claim_1' is not a PersistentVolumeClaim name"),
        ("s3://bucket/sql", "scheme 's3' is not supported"),
        ("/adapters/sql", "no scheme is not supported"),
        ("file://host/adapters/sql", "not a file URI of an absolute path"),
        ("file:relative/sql", "not a file URI of an absolute path"),
        ("hf://just-a-name", "expected hf://org/name[@revision]"),
        ("hf://org/name@", "empty revision"),
        ("https://host/adapters/sql.zip", "must name a .tar.gz, .tgz or .tar archive"),
        ("https://host/sql.tar.gz#md5=00", "the only fragment understood is #sha256="),
        ("https:///sql.tar.gz", "the URL has no host"),
    ],
)
def test_other_sources_are_refused_naming_the_field_the_value_and_what_is_accepted(source, words) -> None:
    with pytest.raises(ValueError) as refused:
        d.adapter_path(source)
    message = str(refused.value)
    assert message.startswith(f"spec.source {source!r}: ") and words in message
    assert "file:///absolute/path" in message and "hf://org/name[@revision]" in message
    assert "http(s)://…/adapter.tar.gz" in message and "pvc://<claim>/<folder>" in message


def test_a_pvc_source_is_its_folder_where_the_replicas_mount_the_bases_adapter_claim() -> None:
    """The claim is mounted as a pvc:// model's is (model_source.claim_mount), at /mnt/lora-adapters/<claim>."""
    path = d.adapter_path("pvc://adapters-data/team-a/./sql/")
    assert path == "/mnt/lora-adapters/adapters-data/team-a/sql" and not d.is_fetched(path)
    assert d.source_claim("pvc://adapters-data/team-a/sql") == "adapters-data"
    assert d.source_claim("file:///adapters/sql") is None and d.source_claim("hf://org/sql") is None
    spec, problems = d.check({"inferenceService": "base", "source": "pvc://adapters-data/sql"})
    assert spec is not None and problems == []


def test_a_refusal_never_shows_a_password_or_a_query() -> None:
    with pytest.raises(ValueError) as refused:
        d.adapter_path("https://user:hunter2@host/sql.tar.gz?sig=secret")
    message = str(refused.value)
    assert "credentials in the URL are not supported" in message
    assert "hunter2" not in message and "secret" not in message and "user:***@host" in message


def test_check_words_problems_for_the_webhook_and_the_valid_condition() -> None:
    spec, problems = d.check({"inferenceService": "base", "source": "file:///adapters/sql"})
    assert spec is not None and problems == []
    spec, (problem,) = d.check({"inferenceService": "base", "source": "s3://bucket/sql"})
    assert spec is not None and problem.field == "spec.source" and problem.reason == "InvalidSource"
    assert "'s3://bucket/sql'" in problem.message
    spec, problems = d.check({"source": "file:///a"})
    assert spec is None and problems[0].field == "spec.inferenceService"


# -- the base service ---------------------------------------------------------------------------------------
def _base(lora: dict | None = None, served: str | None = None) -> dict:
    model = {"uri": "file:///models/tiny", **({"servedName": served} if served else {})}
    return {"spec": {"model": model, "engine": {"lora": lora} if lora is not None else {}}}


ON = {"enabled": True, "adapterDir": "/adapters"}


def test_the_base_must_exist_serve_adapters_from_a_folder_holding_the_source_under_another_name() -> None:
    path = "/adapters/sql"
    assert d.base_problem("sql", "ns", "base", None, path)[0] == "BaseServiceNotFound"
    reason, message = d.base_problem("sql", "ns", "base", _base(), path) or ("", "")
    assert reason == "LoRANotEnabled" and "spec.engine.lora.enabled" in message
    assert d.base_problem("sql", "ns", "base", _base({"enabled": False}), path)[0] == "LoRANotEnabled"
    reason, message = d.base_problem("sql", "ns", "base", _base({"enabled": True}), path) or ("", "")
    assert reason == "NoAdapterDir" and "spec.engine.lora.adapterDir" in message and path in message
    assert d.base_problem("sql", "ns", "base", _base(ON), path) is None
    for outside in ("/adapters-other/sql", "/srv/sql", "/adapters"):
        reason, message = d.base_problem("sql", "ns", "base", _base(ON), outside) or ("", "")
        assert reason == "SourceOutsideAdapterDir" and outside in message and "/adapters" in message
    assert d.base_problem("tiny", "ns", "base", _base(ON, served="tiny"), path)[0] == "NameTaken"
    assert d.base_problem("base", "ns", "base", _base(ON), path)[0] == "NameTaken"


def test_a_pvc_source_must_name_the_claim_the_base_mounts() -> None:
    """The replicas mount the base's spec.engine.lora.adapterClaim only: a pvc source names it, or it is
    refused naming the field, the value and what is accepted (the Ready condition, and the webhook when the
    base exists: mount_problem)."""
    source = "pvc://data/team-a/sql"
    path, claim = d.adapter_path(source), d.source_claim(source)
    claimed = {"enabled": True, "adapterClaim": "data"}
    assert d.base_problem("sql", "ns", "base", _base(claimed), path, claim) is None
    assert d.mount_problem("ns", "base", _base(claimed), path, claim) is None
    reason, message = d.base_problem("sql", "ns", "base", _base(ON), path, claim) or ("", "")
    assert reason == "NoAdapterClaim" and message.startswith(f"spec.source {source!r}: ")
    assert "sets no spec.engine.lora.adapterClaim" in message and "set adapterClaim to 'data'" in message
    other = {"enabled": True, "adapterClaim": "other"}
    reason, message = d.base_problem("sql", "ns", "base", _base(other), path, claim) or ("", "")
    assert reason == "SourceOutsideAdapterClaim" and message.startswith(f"spec.source {source!r}: ")
    assert "claim 'data' is not 'other'" in message and "accepted: pvc://other/<folder>" in message
    assert d.mount_problem("ns", "base", _base(other), path, claim) == (reason, message)
    # A file source is still adapterDir's, whatever claim the base mounts.
    assert d.base_problem("sql", "ns", "base", _base(claimed), "/adapters/sql")[0] == "NoAdapterDir"
    # The webhook asks only about a base that exists and serves adapters; the rest is the Ready condition's.
    assert d.mount_problem("ns", "base", None, path, claim) is None
    assert d.mount_problem("ns", "base", _base({"enabled": False}), path, claim) is None
    assert d.mount_problem("ns", "base", {"spec": {"model": 3}}, path, claim) is None
    assert d.base_problem("sql", "ns", "base", _base({"enabled": False}), path, claim)[0] == "LoRANotEnabled"


def test_every_reason_a_base_blocks_an_adapter_with_is_one_the_gateway_refuses_at_once() -> None:
    """The gateway holds an adapter's requests while it is Loading, and refuses them at once for these
    reasons (gateway/core/adapters.py BLOCKED_REASONS, which cannot import the operator): none may be
    missing there, or its requests would wait for a load that never comes."""
    from flotilla.gateway.core.adapters import BLOCKED_REASONS
    from flotilla.ownership import Owner

    path, claim = "/mnt/lora-adapters/data/sql", "data"
    cases = [
        (None, "/adapters/sql", None),
        ({"spec": {"model": 3}}, "/adapters/sql", None),
        (_base({"enabled": False}), "/adapters/sql", None),
        (_base({"enabled": True}), "/adapters/sql", None),
        (_base(ON), "/elsewhere/sql", None),
        (_base(ON), path, claim),
        (_base({"enabled": True, "adapterClaim": "other"}), path, claim),
    ]
    reasons = {d.base_problem("sql", "ns", "base", base, p, c)[0] for base, p, c in cases}  # type: ignore[index]
    reasons.add(d.base_problem("tiny", "ns", "base", _base(ON, served="tiny"), "/adapters/sql")[0])  # type: ignore[index]
    reasons.add(d.sharing_problem(Owner("a", ("t1",)), Owner("b", ("t2",)))[0])  # type: ignore[index]
    assert len(reasons) == 9 and reasons <= BLOCKED_REASONS, reasons - BLOCKED_REASONS


def test_a_fetched_source_needs_no_adapter_dir_but_lora_and_its_own_name() -> None:
    """Each replica's engine fetches an hf:// or http(s) source into its own cache: no node folder."""
    for uri in ("hf://org/sql", "https://host/sql.tar.gz"):
        assert d.base_problem("sql", "ns", "base", _base({"enabled": True}), uri) is None
        assert d.base_problem("sql", "ns", "base", _base(ON), uri) is None
        assert d.base_problem("sql", "ns", "base", _base({"enabled": False}), uri)[0] == "LoRANotEnabled"
        assert d.base_problem("tiny", "ns", "base", _base(ON, served="tiny"), uri)[0] == "NameTaken"


def test_an_engine_serving_a_fetched_source_shows_it_without_secrets_and_a_round_compares_that() -> None:
    """The engine's /v1/models root of a fetched adapter is the URI without its query (a presigned URL's
    signature): the operator compares the same form, so a loaded adapter is not reloaded every round, and
    its status never shows the signature."""
    uri = "https://bucket.host/sql.tar.gz?X-Amz-Signature=secret"
    shown = "https://bucket.host/sql.tar.gz?…"
    listing = {
        "data": [
            {"id": "sql", "root": shown, "parent": "tiny"},
            {"id": "hub", "root": "hf://o/n@v1", "parent": "tiny"},
        ]
    }
    served = d.served_adapters(listing)
    assert served == {"sql": shown, "hub": "hf://o/n@v1"}  # URIs are not normalized as paths
    assert d.step("sql", uri, served) is d.Step.NOTHING
    assert d.step("hub", "hf://o/n@v1", served) is d.Step.NOTHING
    assert d.step("hub", "hf://o/n@v2", served) is d.Step.RELOAD
    loaded = d.load_outcome(200, "Success", None, "sql", uri)
    raced = d.load_outcome(400, "already loaded", served, "sql", uri)
    assert loaded == raced == d.Outcome(d.LOADED, "Loaded", f"loaded from {shown}")
    assert "secret" not in loaded.message


def test_adapter_dir_is_mounted_read_only_at_its_own_path(make_spec, owner, decision, config) -> None:
    from flotilla.operator.desired.workload import LORA_ADAPTERS_VOLUME, deployment

    spec = make_spec(engine={"lora": {"enabled": True, "adapterDir": "/srv/adapters/"}})
    pod = deployment(owner, spec, decision, config)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == LORA_ADAPTERS_VOLUME]
    assert volume["hostPath"] == {"path": "/srv/adapters", "type": "Directory"}
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == LORA_ADAPTERS_VOLUME]
    assert mount == {"name": LORA_ADAPTERS_VOLUME, "mountPath": "/srv/adapters", "readOnly": True}
    # Without LoRA (or without a folder) the pod template is what it was: no rollout of existing services.
    for engine in ({}, {"lora": {"enabled": True}}):
        plain = deployment(owner, make_spec(engine=engine), decision, config)["spec"]["template"]["spec"]
        assert [v["name"] for v in plain["volumes"]] == [v["name"] for v in pod["volumes"] if v is not volume]


def test_adapter_claim_is_mounted_read_only_as_a_pvc_models_claim_is(
    make_spec, owner, decision, config
) -> None:
    from flotilla.operator.desired.model_source import LORA_ADAPTER_CLAIM
    from flotilla.operator.desired.workload import LORA_ADAPTERS_VOLUME, deployment

    lora = {"enabled": True, "adapterClaim": "adapters-data", "adapterDir": "/srv/adapters"}
    pod = deployment(owner, make_spec(engine={"lora": lora}), decision, config)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == LORA_ADAPTER_CLAIM.volume]
    assert volume["persistentVolumeClaim"] == {"claimName": "adapters-data", "readOnly": True}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts[LORA_ADAPTER_CLAIM.volume] == {
        "name": LORA_ADAPTER_CLAIM.volume,
        "mountPath": "/mnt/lora-adapters/adapters-data",
        "readOnly": True,
    }
    assert mounts[LORA_ADAPTERS_VOLUME]["mountPath"] == "/srv/adapters"  # beside adapterDir's
    # The folder a pvc source names is in that mount.
    assert d.adapter_path("pvc://adapters-data/sql").startswith(
        mounts[LORA_ADAPTER_CLAIM.volume]["mountPath"] + "/"
    )
    # Beside a pvc:// model (its own volume and mount point), and alone.
    spec = make_spec(
        model={"uri": "pvc://models/tiny"}, engine={"lora": {"enabled": True, "adapterClaim": "models"}}
    )
    pod = deployment(owner, spec, decision, config)["spec"]["template"]["spec"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims == {"model": "models", LORA_ADAPTER_CLAIM.volume: "models"}
    paths = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
    assert "/mnt/models/models" in paths and "/mnt/lora-adapters/models" in paths


# -- replicas and what they serve ---------------------------------------------------------------------------
def _pod(name: str, ip: str | None = "127.7.0.5", ready: bool = True, deleting: bool = False) -> dict:
    meta = {"name": name, **({"deletionTimestamp": NOW} if deleting else {})}
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_only_ready_pods_with_an_ip_that_are_not_terminating_are_replicas() -> None:
    pods = [
        _pod("b", "127.7.0.6"),
        _pod("a"),
        _pod("c", ready=False),
        _pod("d", ip=None),
        _pod("e", deleting=True),
    ]
    assert d.ready_replicas(pods) == [
        d.Replica("a", "http://127.7.0.5:8000/v1"),
        d.Replica("b", "http://127.7.0.6:8000/v1"),
    ]


LISTING = {
    "data": [
        {"id": "tiny", "root": "tiny", "parent": None},
        {"id": "sql", "root": "/adapters/sql/", "parent": "tiny"},
        {"id": "chat", "root": "/adapters/chat", "parent": "tiny"},
    ]
}


def test_served_adapters_are_the_listings_entries_with_a_parent() -> None:
    assert d.served_adapters(LISTING) == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    assert d.served_adapters({}) == {}


def test_the_step_loads_what_is_missing_and_reloads_what_came_from_elsewhere() -> None:
    served = d.served_adapters(LISTING)
    assert d.step("sql", "/adapters/sql", served) is d.Step.NOTHING
    assert d.step("sql", "/adapters/sql-v2", served) is d.Step.RELOAD
    assert d.step("new", "/adapters/new", served) is d.Step.LOAD


def test_load_outcomes() -> None:
    assert d.load_outcome(200, "Success", None, "sql", "/a").phase == d.LOADED
    refused = d.load_outcome(400, "lora_path '/a': no adapter_config.json", {}, "sql", "/a")
    assert (refused.phase, refused.reason) == (
        d.FAILED,
        "LoadRefused",
    ) and "no adapter_config.json" in refused.message
    # A 400 "already loaded" that another round's load of the same folder caused is a success.
    assert d.load_outcome(400, "already loaded", {"sql": "/a"}, "sql", "/a").phase == d.LOADED
    assert d.load_outcome(400, "already loaded", {"sql": "/b"}, "sql", "/a").phase == d.FAILED
    for code in (0, 503, 429):
        assert d.load_outcome(code, "busy", None, "sql", "/a").phase == d.LOADING


def test_unload_outcomes_retry_what_is_in_use_or_unanswered() -> None:
    assert d.unload_outcome(200) is d.Unload.DONE and d.unload_outcome(404) is d.Unload.DONE
    assert {d.unload_outcome(c) for c in (0, 409, 500, 503)} == {d.Unload.RETRY}
    assert d.unload_outcome(400) is d.Unload.FAILED


# -- status ---------------------------------------------------------------------------------------------------
def _status(outcomes: dict, previous: dict | None = None, now: str = NOW, **kwargs) -> dict:
    args = {"invalid": None, "blocked": None, "ready_count": len(outcomes)} | kwargs
    return d.status(name="sql", generation=2, outcomes=outcomes, previous=previous or {}, now=now, **args)


def _ready(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def test_ready_when_loaded_in_every_ready_replica() -> None:
    loaded = d.Outcome(d.LOADED, "Loaded", "loaded from /a")
    status = _status({"p1": loaded, "p0": loaded})
    assert [r["pod"] for r in status["replicas"]] == ["p0", "p1"]
    assert (status["loadedReplicas"], status["readyReplicas"], status["servedName"]) == (2, 2, "sql")
    assert _ready(status)["status"] == "True" and _ready(status)["observedGeneration"] == 2

    waiting = _status({"p0": loaded, "p1": d.Outcome(d.LOADING, "LoadPending", "503")})
    assert (_ready(waiting)["status"], _ready(waiting)["reason"]) == ("False", "Loading")
    failed = _status({"p0": loaded, "p1": d.Outcome(d.FAILED, "LoadRefused", "rank 128 above 64")})
    assert _ready(failed)["reason"] == "LoadFailed" and "p1: rank 128 above 64" in _ready(failed)["message"]
    assert _ready(_status({}))["reason"] == "NoReadyReplicas"


def test_an_invalid_or_blocked_adapter_is_not_ready_and_says_why() -> None:
    invalid = _status({}, invalid="spec.source: scheme 'hf' is not supported")
    valid = next(c for c in invalid["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False" and "spec.source" in valid["message"]
    blocked = _status({}, blocked=("LoRANotEnabled", "set enabled"))
    assert (_ready(blocked)["reason"], _ready(blocked)["message"]) == ("LoRANotEnabled", "set enabled")


def test_a_round_that_changes_nothing_writes_the_same_status() -> None:
    loaded = {"p0": d.Outcome(d.LOADED, "Loaded", "loaded from /a")}
    first = _status(loaded)
    assert _status(loaded, previous=first, now=LATER) == first
    # A phase that changes gets a new transition time; the condition that changes too.
    pending = _status({"p0": d.Outcome(d.LOADING, "LoadPending", "503")}, previous=first, now=LATER)
    assert pending["replicas"][0]["lastTransitionTime"] == LATER
    assert _ready(pending)["lastTransitionTime"] == LATER


# -- the Tenant's limit -------------------------------------------------------------------------------------
def test_the_tenants_limit_refuses_the_adapter_past_it_naming_tenant_count_and_limit() -> None:
    existing = [("team-a", "sql"), ("team-a-dev", "chat")]
    refusal = adapter_limit_refusal(tenant="acme", limit=2, namespace="team-a", name="new", existing=existing)
    assert refusal is not None
    assert "tenant acme" in refusal and "team-a/new" in refusal and "number 3" in refusal
    assert "maxLoRAAdapters is 2" in refusal and "2 are registered" in refusal
    assert (
        adapter_limit_refusal(tenant="acme", limit=3, namespace="team-a", name="new", existing=existing)
        is None
    )
    # An object counts once (a re-apply of a stored one is not a new one), and no limit or no tenant: no refusal.
    assert (
        adapter_limit_refusal(tenant="acme", limit=2, namespace="team-a", name="sql", existing=existing)
        is None
    )
    assert (
        adapter_limit_refusal(tenant="acme", limit=None, namespace="a", name="n", existing=existing) is None
    )
    assert adapter_limit_refusal(tenant=None, limit=0, namespace="a", name="n", existing=[]) is None
    assert adapter_limit_refusal(tenant="acme", limit=0, namespace="a", name="n", existing=[]) is not None


def test_the_tenant_field_is_spelled_maxLoRAAdapters() -> None:
    spec = TenantSpec.model_validate({"maxLoRAAdapters": 3})
    assert spec.max_lora_adapters == 3 and spec.to_wire()["maxLoRAAdapters"] == 3


# -- spec.engine.lora ---------------------------------------------------------------------------------------
def test_spec_engine_lora_becomes_the_engines_flags(make_spec) -> None:
    spec = make_spec(engine={"lora": {"enabled": True, "maxLoras": 2, "maxLoraRank": 16, "maxCpuLoras": 8}})
    assert engine_flags(spec.engine) == [
        FLAG_ENABLE_LORA, FLAG_MAX_LORAS, "2", FLAG_MAX_LORA_RANK, "16", FLAG_MAX_CPU_LORAS, "8",
    ]  # fmt: skip
    assert engine_flags(make_spec(engine={"lora": {"enabled": False}}).engine) == []
    assert engine_flags(make_spec().engine) == []


def _lora_problems(make_spec, **engine):
    return [p for p in validate(make_spec(engine=engine), gpu_types=None, path_exists=None)]


def test_spec_engine_lora_rules_across_fields(make_spec) -> None:
    assert _lora_problems(make_spec, lora={"enabled": True, "maxLoras": 8, "maxCpuLoras": 8}) == []
    (p,) = _lora_problems(make_spec, lora={"maxLoras": 2})
    assert p.field == "spec.engine.lora.enabled" and "maxLoras set while enabled is unset" in p.message
    (p,) = _lora_problems(make_spec, lora={"enabled": True}, quantization="int8")
    assert p.field == "spec.engine.lora.enabled" and "quantization 'int8'" in p.message
    (p,) = _lora_problems(make_spec, lora={"enabled": True, "maxLoras": 32})
    assert p.field == "spec.engine.lora.maxCpuLoras" and "16 is below maxLoras (32)" in p.message
    assert _lora_problems(make_spec, lora={"enabled": True}, quantization="none") == []
    (p,) = _lora_problems(make_spec, lora={"adapterDir": "/adapters"})
    assert p.field == "spec.engine.lora.enabled" and "adapterDir set" in p.message
    (p,) = _lora_problems(make_spec, lora={"enabled": False, "adapterClaim": "data"})
    assert p.field == "spec.engine.lora.enabled" and "adapterClaim set while enabled is false" in p.message
    spec = make_spec(engine={"lora": {"enabled": True, "adapterDir": "/nowhere"}})
    (p,) = validate(spec, gpu_types=None, path_exists=lambda path: path != "/nowhere")
    assert (
        p.field == "spec.engine.lora.adapterDir"
        and p.reason == "AdapterDirNotFound"
        and "/nowhere" in p.message
    )
