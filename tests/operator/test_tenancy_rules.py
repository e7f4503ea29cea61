"""Tenants' namespaces, bad Tenants, members' RBAC objects, webhook TLS material, the usage report."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from cryptography import x509
from pydantic import ValidationError

from flotilla.operator.api.v1alpha1 import MeteringLedger, TenantSpec, TenantStatus, TokenCount
from flotilla.operator.controllers import webhook_tls
from flotilla.operator.controllers.webhook_server import missing_namespace_message
from flotilla.operator.tenancy.rbac import MEMBER_ROLE, desired_objects
from flotilla.operator.tenancy.rules import namespaces_owned, tenant_of, tenant_problems
from flotilla.operator.tenancy.usage import WindowError, check_window, render, report

NOW = dt.datetime(2026, 1, 10, tzinfo=dt.UTC)


def test_namespaces_by_list_and_selector():
    a = TenantSpec(namespaces=["a1"], namespace_selector={"matchLabels": {"team": "a"}})
    labels = {"a1": {}, "a2": {"team": "a"}, "b1": {"team": "b"}}
    assert namespaces_owned("ta", {"ta": a}, labels) == ["a1", "a2"]
    assert tenant_of("a2", {"ta": a}, labels) == "ta" and tenant_of("b1", {"ta": a}, labels) is None


def test_a_namespace_claimed_twice_or_an_unpriced_type_is_refused():
    a = TenantSpec(namespaces=["a1"])
    thief = TenantSpec.model_validate(
        {"namespaces": ["a1", "x"], "gpuQuota": {"h100": 1}, "pricePerGPUHour": {"a100": 1.0}}
    )
    problems = tenant_problems("thief", thief, {"a": a}, {})
    assert "namespace a1 already belongs to tenant a" in problems[0]
    assert "pricePerGPUHour names a100" in problems[1]
    assert tenant_problems("a", a, {"a": a}, {}) == []
    with pytest.raises(ValidationError):
        TenantSpec(gpu_quota={"h100": -1})


def test_members_get_their_namespaces_and_only_get_their_tenant():
    spec = TenantSpec(namespaces=["a1"], gpu_quota={"h100": 2, "a100": 1},
                      members=[{"kind": "Group", "name": "devs"}, {"kind": "ServiceAccount", "name": "ci", "namespace": "a1"}])  # fmt: skip
    objects = {
        (o["kind"], o["metadata"].get("namespace")): o for o in desired_objects("ta", "uid", spec, ["a1"])
    }
    role = objects[("ClusterRole", None)]
    assert role["rules"] == [
        {"apiGroups": ["flotilla.dev"], "resources": ["tenants"], "resourceNames": ["ta"], "verbs": ["get"]}
    ]
    binding = objects[("RoleBinding", "a1")]
    assert binding["roleRef"]["name"] == MEMBER_ROLE
    assert {"kind": "ServiceAccount", "name": "ci", "namespace": "a1"} in binding["subjects"]
    assert objects[("ResourceQuota", "a1")]["spec"]["hard"] == {"requests.nvidia.com/gpu": "3"}
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "uid" for o in objects.values())


def test_webhook_material_is_reused_and_renewed_from_the_same_ca():
    first = webhook_tls.ensure(None, ["127.0.0.1"], NOW)
    assert webhook_tls.ensure(first, ["127.0.0.1"], NOW) is first
    cert = x509.load_pem_x509_certificate(first.cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    other_host = webhook_tls.ensure(first, ["webhook.example"], NOW)
    assert other_host.ca_cert == first.ca_cert and other_host.cert != first.cert
    late = webhook_tls.ensure(first, ["127.0.0.1"], NOW + dt.timedelta(days=webhook_tls.SERVING_DAYS - 1))
    assert late.ca_cert == first.ca_cert and late.cert != first.cert
    again = webhook_tls.Material.from_secret_data(first.to_secret_data())
    assert again == first


def test_a_missing_operator_namespace_is_named_with_the_manifest_that_creates_it():
    default = missing_namespace_message("flotilla-system")
    assert "namespace flotilla-system does not exist" in default
    assert "`kubectl apply -f deploy/operator-rbac.yaml`" in default and "\n" not in default
    # deploy/operator-rbac.yaml is rendered for flotilla-system; another namespace needs it rendered anew.
    other = missing_namespace_message("ops")
    assert "`flotilla operator rbac --namespace ops && kubectl apply -f deploy/operator-rbac.yaml`" in other
    manifest = (Path(__file__).resolve().parents[2] / "deploy" / "operator-rbac.yaml").read_text()
    assert "kind: Namespace\nmetadata:\n  name: flotilla-system\n" in manifest


def test_usage_report_all_time_and_by_day():
    spec = TenantSpec.model_validate(
        {"namespaces": ["a1"], "gpuQuota": {"h100": 2}, "pricePerGPUHour": {"h100": 3.6}}
    )
    status = TenantStatus(
        tokens=TokenCount(input=600_000, output=400_000),
        ledger=MeteringLedger(
            total={"a1/chat/h100": 7200.0},
            daily={"2026-01-01": {"a1/chat/h100": 3600.0}, "2026-01-02": {"a1/chat/h100": 3600.0}},
        ),
    )
    everything = report("ta", spec, status, None, None)
    assert everything.gpu_seconds == 7200 and everything.cost == pytest.approx(7.2)
    assert everything.cost_per_million_tokens == pytest.approx(7.2)
    one_day = report("ta", spec, status, dt.date(2026, 1, 2), dt.date(2026, 1, 2))
    assert one_day.gpu_seconds == 3600 and one_day.rows[0].service == "chat"
    assert json.loads(render([one_day], "json", {}))["tenants"][0]["cost"] == pytest.approx(3.6)
    assert render([one_day], "csv", {}).splitlines()[1] == "ta,a1,chat,h100,3600.0,1.0,3.6,3.6"
    assert "GPU SECONDS" in render([one_day], "table", {"since": "2026-01-02"})
    with pytest.raises(WindowError):
        check_window(dt.date(2026, 1, 3), dt.date(2026, 1, 2), dt.date(2026, 1, 10))
    with pytest.raises(WindowError):
        check_window(dt.date(2025, 1, 1), None, dt.date(2026, 1, 10))


def test_a_mounted_webhook_tls_folder_without_its_files_stops_naming_them(tmp_path):
    with pytest.raises(SystemExit, match=r"--webhook-tls-dir .*: missing .*tls\.crt, .*tls\.key"):
        webhook_tls.mounted_files(tmp_path)
    (tmp_path / "tls.crt").write_text("cert")
    (tmp_path / "tls.key").write_text("key")
    assert webhook_tls.mounted_files(tmp_path) == (None, tmp_path / "tls.crt", tmp_path / "tls.key")
    (tmp_path / "ca.crt").write_text("ca")
    assert webhook_tls.mounted_files(tmp_path)[0] == tmp_path / "ca.crt"


def test_the_backstop_partitions_the_quota_over_the_namespaces():
    from flotilla.operator.tenancy.backstop import namespace_limits

    # Nothing held: the quota split evenly, the remainder to the first by name; never more than the quota.
    assert namespace_limits(2, ["b", "a"], {}, {}) == {"a": 1, "b": 1}
    assert namespace_limits(3, ["a", "b"], {}, {}) == {"a": 2, "b": 1}
    # What a namespace holds (grants, or pods someone else made) is its own; the free rest is split.
    assert namespace_limits(4, ["a", "b"], {"a": 2}, {"b": 1}) == {"a": 3, "b": 1}
    assert namespace_limits(4, ["a", "b"], {"a": 2}, {"a": 3}) == {"a": 4, "b": 0}
    # More held than the quota (made before the backstop, or a lowered quota): nothing new anywhere.
    assert namespace_limits(2, ["a", "b"], {"a": 2}, {"b": 2}) == {"a": 2, "b": 2}
    for quota in range(6):
        for held_a in range(4):
            limits = namespace_limits(quota, ["a", "b", "c"], {"a": held_a}, {})
            assert sum(limits.values()) == max(quota, held_a) and limits["a"] >= held_a


def test_a_selector_expression_whose_values_do_not_fit_its_operator_is_refused_naming_them():
    with pytest.raises(ValidationError) as exc:
        TenantSpec.model_validate(
            {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": []}]}}
        )
    assert "matchExpressions (key team).values is empty; operator In needs at least one value" in str(
        exc.value
    )
    with pytest.raises(ValidationError) as exc:
        TenantSpec.model_validate(
            {"namespaceSelector": {"matchExpressions": [{"key": "t", "operator": "Exists", "values": ["x"]}]}}
        )
    assert "values has 1 values; operator Exists takes none" in str(exc.value)
    with pytest.raises(ValidationError):  # the schema's enum: the API server refuses it first
        TenantSpec.model_validate(
            {"namespaceSelector": {"matchExpressions": [{"key": "t", "operator": "Near"}]}}
        )


def test_usage_report_lists_each_adapters_tokens_and_cost():
    from flotilla.operator.api.v1alpha1 import AdapterUsage

    spec = TenantSpec.model_validate({"namespaces": ["a1"], "pricePerGPUHour": {"h100": 3.6}})
    status = TenantStatus(
        tokens=TokenCount(input=600_000, output=400_000),
        adapters={"a1/fr": AdapterUsage(input=200_000, output=50_000, cost=1.0)},
        ledger=MeteringLedger(total={"a1/chat/h100": 7200.0}),
    )
    r = report("ta", spec, status, None, None)
    assert [(a.namespace, a.adapter, a.tokens_input, a.tokens_output) for a in r.adapters] == [
        ("a1", "fr", 200_000, 50_000)
    ]
    assert r.adapters[0].cost == pytest.approx(1.8)  # a quarter of the tokens: a quarter of 7.2
    table = render([r], "table", {})
    assert "LoRA adapters" in table
    assert ["ta", "a1", "fr", "200000", "50000", "1.8"] in [line.split() for line in table.splitlines()]
    assert "ta,a1,fr,200000,50000,1.8" in render([r], "csv", {}).splitlines()
    assert json.loads(render([r], "json", {}))["tenants"][0]["adapters"][0]["adapter"] == "fr"
