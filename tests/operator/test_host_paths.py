"""No host path by a tenant's choice: the one rule (desired/host_paths.allowed), the operator's setting
(OperatorConfig.host_path_roots, --host-path-root, the chart's operator.hostPathRoots), the webhook's and
the reconciler's refusals naming the field, the value and the roots, and the hf cache kept to itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.cli import build_parser
from flotilla.operator.api.v1alpha1 import TenantSpec
from flotilla.operator.cmd import cli, local_chart
from flotilla.operator.cmd.local import OperatorProcess
from flotilla.operator.config import OperatorConfig
from flotilla.operator.controllers.webhook_reviews import review_service
from flotilla.operator.desired.host_paths import allowed, normalize
from flotilla.operator.desired.model_source import ModelUri, ModelUriError, model_mount, parse_model_uri
from flotilla.operator.desired.reconcile import World, plan

ROOTS = ("/data", "/srv/adapters")


# -- the rule -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "ok"),
    [
        ("/data", True),  # a root itself
        ("/data/", True),  # its trailing slash
        ("/data/models/tiny", True),  # under it
        ("/data/./models//tiny/", True),  # normalized first
        ("/data/models/../other", True),  # `..` that stays inside
        ("/data/..", False),  # `..` out of the root
        ("/data/../etc/kubernetes", False),
        ("/data/models/../../var/lib/kubelet", False),
        ("/data-evil", False),  # a prefix of the name, not a parent folder
        ("/data-evil/models", False),
        ("/dat", False),
        ("/", False),
        ("/etc/kubernetes", False),
        ("//data/models", True),  # Linux reads a leading // as /
        ("//etc", False),
        ("data/models", False),  # relative: never a host path
        ("./data", False),
        ("", False),
        ("/srv/adapters/sql", True),  # the second root
        ("/srv", False),  # a parent of a root is not under it
    ],
)
def test_a_path_is_allowed_only_at_or_under_a_root(path, ok):
    assert allowed(path, ROOTS) is ok


def test_roots_are_normalized_and_relative_roots_count_for_nothing():
    assert (
        allowed("/data/m", ["/data/"])
        and allowed("/data/m", ["/data/x/.."])
        and allowed("/data/m", ["//data"])
    )
    assert not allowed("/data/m", ["data"])  # the operator's working directory is no node folder
    assert not allowed("/data/m", [])  # no roots, no host path
    assert allowed("/etc/kubernetes", ["/"])  # a platform may allow everything, but must say so


def test_normalize_is_the_path_mounted():
    assert normalize("/data/./a//b/") == "/data/a/b"
    assert normalize("//data/a") == "/data/a"
    assert normalize("/data/a/../../etc") == "/etc"


# -- the setting ------------------------------------------------------------------------------------------------
def test_the_config_allows_none_by_default_and_refuses_a_relative_root():
    assert OperatorConfig().host_path_roots == ()
    roots = ["/data/", "/srv"]  # a list from the flags: kept as the frozen config's tuple
    assert OperatorConfig(host_path_roots=roots).host_path_roots == ("/data/", "/srv")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"--host-path-root 'models': not an absolute path"):
        OperatorConfig(host_path_roots=("models",))
    with pytest.raises(ValueError, match=r"--hf-cache-dir 'cache': not an absolute path"):
        OperatorConfig(hf_cache_dir="cache")


def _run_config(monkeypatch, *argv: str) -> OperatorConfig:
    """The OperatorConfig `flotilla operator run ARGV` would run with (the operator itself not started)."""
    from flotilla.operator.controllers import runner

    seen: list[OperatorConfig] = []
    monkeypatch.setattr(runner, "run_operator", lambda config, **_: seen.append(config) or 0)
    args = build_parser().parse_args(["operator", "run", *argv])
    assert cli._run(args) == 0
    return seen[0]


def test_the_flag_feeds_the_config(monkeypatch):
    assert _run_config(monkeypatch).host_path_roots == ()
    config = _run_config(monkeypatch, "--host-path-root", "/data", "--host-path-root=/srv/adapters")
    assert config.host_path_roots == ("/data", "/srv/adapters")
    with pytest.raises(SystemExit, match=r"--host-path-root 'rel': not an absolute path"):
        _run_config(monkeypatch, "--host-path-root", "rel")


def test_the_local_cluster_allows_its_model_and_adapter_folders(tmp_path):
    values = local_chart.local_values(30001, (Path("/srv/models"),), host_path_roots=(Path("/srv/adapters"),))
    assert values["operator"]["hostPathRoots"] == ["/srv/models", "/srv/adapters"]
    operator = OperatorProcess(tmp_path / "kubeconfig", tmp_path / "log", ("--verbose",), (Path("/srv/m"),))
    argv = operator.argv()
    assert argv[argv.index("--host-path-root") + 1] == "/srv/m" and argv[-1] == "--verbose"
    assert "--host-path-root" not in OperatorProcess(tmp_path / "k", tmp_path / "l").argv()


# -- the webhook ------------------------------------------------------------------------------------------------
TENANT = TenantSpec(namespaces=["a"], gpu_quota={"h100": 4})


def _raw(uri: str = "file:///data/tiny", **engine) -> dict:
    return {"model": {"uri": uri}, "resources": {"gpus": 1, "gpuType": "h100"}, "engine": engine}


def _review(raw: dict, roots: tuple[str, ...], old_raw: dict | None = None):
    return review_service(key=("a", "s"), new_raw=raw, old_raw=old_raw, tenant="team-a", tenant_spec=TENANT,
                          others=[], host_path_roots=roots)  # fmt: skip


LORA = {"enabled": True, "adapterDir": "/etc/kubernetes/../kubernetes"}
DRAFT = {"method": "draft", "model": {"uri": "file:///var/lib/kubelet"}}


@pytest.mark.parametrize(
    ("raw", "field", "value", "path"),
    [
        (_raw("file:///etc/kubernetes"), "spec.model.uri", "file:///etc/kubernetes", "/etc/kubernetes"),
        (_raw("file:///data/../etc"), "spec.model.uri", "file:///data/../etc", "/etc"),
        (_raw("file:///data-evil/m"), "spec.model.uri", "file:///data-evil/m", "/data-evil/m"),
        (_raw(lora=LORA), "spec.engine.lora.adapterDir", LORA["adapterDir"], "/etc/kubernetes"),
        (
            _raw(speculative=DRAFT),
            "spec.engine.speculative.model.uri",
            "file:///var/lib/kubelet",
            "/var/lib/kubelet",
        ),
    ],
    ids=["model", "model-dotdot", "model-prefix", "adapter-dir", "draft-model"],
)
def test_the_webhook_refuses_a_host_path_outside_the_roots_naming_field_value_and_roots(
    raw, field, value, path
):
    verdict, held = _review(raw, ROOTS)
    assert not verdict.allowed and held is None
    assert (verdict.code, verdict.reason) == (422, "HostPathNotAllowed")
    assert verdict.message.startswith(f"{field}: {value!r}")
    assert f"host path {path}" in verdict.message or value == path
    assert "host-path roots the operator allows (/data, /srv/adapters)" in verdict.message


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (_raw(), "spec.model.uri"),
        (
            _raw("hf://acme/tiny", lora={"enabled": True, "adapterDir": "/data/a"}),
            "spec.engine.lora.adapterDir",
        ),
    ],
    ids=["model", "adapter-dir"],
)
def test_with_no_roots_the_webhook_refuses_every_host_path_and_says_none_is_allowed(raw, field):
    verdict, _ = _review(raw, ())
    assert not verdict.allowed and verdict.reason == "HostPathNotAllowed"
    assert verdict.message.startswith(f"{field}: ")
    assert "the operator allows no host paths (no --host-path-root is set)" in verdict.message


def test_with_no_roots_what_is_no_host_path_is_admitted():
    assert _review(_raw("pvc://models/tiny"), ())[0].allowed
    assert _review(_raw("hf://acme/tiny"), ())[0].allowed


def test_the_webhook_admits_a_host_path_under_a_root():
    lora = {"enabled": True, "adapterDir": "/srv/adapters/team-a"}
    verdict, held = _review(_raw("file:///data/tiny", lora=lora), ROOTS)
    assert verdict.allowed and held is not None


# -- the reconciler ---------------------------------------------------------------------------------------------
def _plan(spec: dict, roots: tuple[str, ...], probed: list[str] | None = None):
    """The reconciler's plan; every path it asks about is recorded in `probed` (and exists)."""
    probed = [] if probed is None else probed

    def path_exists(path: str) -> bool:
        probed.append(path)
        return True

    obj = {"metadata": {"name": "s", "namespace": "a", "uid": "u", "generation": 1}, "spec": spec}
    world = World(
        config=OperatorConfig(host_path_roots=roots),
        now="2026-01-01T00:00:00Z",
        gpu_types={"h100"},
        tenants={"team-a": TENANT},
        held_by_others=[],
        deployment=None,
        path_exists=path_exists,
    )
    return plan(obj, world)


def _host_paths(children: list[dict]) -> list[str]:
    return [
        volume["hostPath"]["path"]
        for child in children
        if child["kind"] == "Deployment"
        for volume in child["spec"]["template"]["spec"]["volumes"]
        if "hostPath" in volume
    ]


@pytest.mark.parametrize(
    "spec",
    [_raw("file:///etc/kubernetes"), _raw(lora=LORA), _raw(speculative=DRAFT)],
    ids=["model", "adapter-dir", "draft-model"],
)
def test_the_reconciler_refuses_it_too_and_builds_no_pod(spec):
    """The webhook bypassed (off, or the object stored before it was on): the round itself refuses."""
    probed: list[str] = []
    result = _plan(spec, ROOTS, probed)
    assert result.children == [] and _host_paths(result.children) == []
    valid = next(c for c in result.status["conditions"] if c["type"] == "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "HostPathNotAllowed")
    assert "host-path roots the operator allows (/data, /srv/adapters)" in valid["message"]
    assert [e.reason for e in result.events if e.type == "Warning"] == ["HostPathNotAllowed"]
    # Whether a refused folder exists is never looked at (no probe of the node's disks for a tenant).
    assert not any(p.startswith(("/etc", "/var/lib/kubelet")) for p in probed), probed


def test_the_reconciler_mounts_a_host_path_under_a_root():
    lora = {"enabled": True, "adapterDir": "/srv/adapters/team-a/"}
    draft = {"method": "draft", "model": {"uri": "file:///data/d"}}
    result = _plan(_raw("file:///data/tiny", lora=lora, speculative=draft), ROOTS)
    assert result.problems == []
    assert sorted(_host_paths(result.children)) == ["/data/d", "/data/tiny", "/srv/adapters/team-a"]
    # The same service with no roots allowed: refused, nothing mounted.
    refused = _plan(_raw("file:///data/tiny", lora=lora), ())
    assert refused.children == [] and {p.field for p in refused.problems} == {
        "spec.model.uri",
        "spec.engine.lora.adapterDir",
    }


# -- hf:// in the platform's cache ------------------------------------------------------------------------------
def test_an_hf_model_in_the_platforms_cache_is_mounted_with_no_root_allowed():
    config = OperatorConfig(hf_cache_dir="/var/cache/hf")
    mount = model_mount(parse_model_uri("hf://acme/tiny@v1"), config, "img")
    assert mount.volumes[0]["hostPath"]["path"] == "/var/cache/hf/acme/tiny@v1"
    obj = {"metadata": {"name": "s", "namespace": "a", "uid": "u"}, "spec": _raw("hf://acme/tiny")}
    world = World(config=config, now="2026-01-01T00:00:00Z", gpu_types={"h100"}, tenants={"team-a": TENANT},
                  held_by_others=[], deployment=None)  # fmt: skip
    assert _host_paths(plan(obj, world).children) == ["/var/cache/hf/acme/tiny"]


@pytest.mark.parametrize(
    "uri",
    [
        "hf://acme/tiny@x/../../../../etc",
        "hf://acme/tiny@x/..",
        "hf://acme/tiny@a//b",
        "hf://acme/tiny@main/",
    ],
)
def test_an_hf_revision_cannot_walk_out_of_the_cache(uri):
    with pytest.raises(ModelUriError, match="revision .* has '.' or '..' segments"):
        parse_model_uri(uri)
    verdict, _ = _review(_raw(uri), ROOTS)
    assert not verdict.allowed and verdict.reason == "InvalidModelUri" and "spec.model.uri" in verdict.message


def test_the_cache_mount_refuses_a_location_outside_the_cache_whatever_made_it():
    config = OperatorConfig(hf_cache_dir="/var/cache/hf/")
    for location in ("acme/tiny@x/../../../../etc", "..", "../hf-evil/m"):
        with pytest.raises(ModelUriError, match="is not under the hf cache folder /var/cache/hf"):
            model_mount(ModelUri("hf", location), config, "img")
