"""The recording rules and alerts: the checked-in file is the generator's output, promtool accepts it and
passes every unit test in alerts_test.yaml, every alert has a case that fires it and one that must not,
every series a rule reads is one the project exports, and no rule keeps a per-request label."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flotilla import contract, manifest_yaml
from flotilla.cli import main
from flotilla.monitoring import rules

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = ROOT / "deploy" / "monitoring" / "flotilla-rules.yaml"
ALERTS_TEST = Path(__file__).with_name("alerts_test.yaml")

RECORDED = {r.name for r in rules.records()}


def _unknown(expr: str, known: set[str]) -> set[str]:
    return rules.referenced_series(expr) - known


def test_the_rules_import_only_the_stdlib_yaml_and_the_contract():
    """Dashboards and the chart import the rules; they must not drag in either half. Each module of the
    package may import the others."""
    package = Path(rules.__file__).parent
    imported = set()
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {
            f"{n.module}.{a.name}" if n.module == "flotilla" else str(n.module)
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            for a in n.names
        }
    others = {
        m
        for m in imported
        if m.split(".")[0] not in sys.stdlib_module_names and not m.startswith(f"{rules.__name__}.")
    }
    assert others <= {"yaml", "flotilla.contract", "flotilla.manifest_yaml"}, others


def test_the_checked_in_rules_file_is_the_generators_output():
    assert RULES_FILE.read_text() == rules.render(), "run `flotilla monitoring rules`"


def test_the_rules_command_writes_and_checks(tmp_path, capsys):
    out = tmp_path / "rules.yaml"
    assert main(["monitoring", "rules", "--check", "--out", str(out)]) == 1
    assert f"out of date: {out}" in capsys.readouterr().out
    assert main(["monitoring", "rules", "--out", str(out)]) == 0
    assert main(["monitoring", "rules", "--check", "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == {"groups": rules.rule_groups()}


def test_the_prometheus_rule_carries_the_same_groups():
    rule = rules.prometheus_rule(namespace="monitoring", labels={"release": "kube-prometheus-stack"})
    assert rule["kind"] == "PrometheusRule" and rule["metadata"]["namespace"] == "monitoring"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"]


def test_names_are_unique_and_recorded_names_follow_the_convention():
    names = [r.name for g in rules.GROUPS for r in g.rules]
    assert len(names) == len(set(names))
    assert all(n.startswith("flotilla:") and n.count(":") >= 1 for n in RECORDED)
    assert all(a.name.startswith("Flotilla") and ":" not in a.name for a in rules.alerts())


@pytest.mark.parametrize("rule", [*rules.records(), *rules.alerts()], ids=lambda r: r.name)
def test_every_rule_reads_only_series_the_project_exports(rule, known_series):
    unknown = _unknown(rule.expr, known_series)
    assert rules.referenced_series(rule.expr), "a rule that reads nothing"
    assert not unknown, f"{rule.name} reads series nothing exports: {unknown}"


def test_a_misspelled_series_is_caught(known_series):
    typo = "sum by (tenant) (rate(flotilla_prompt_token_total[5m])) / flotilla:tenant_cost_per_hour"
    assert _unknown(typo, known_series) == {"flotilla_prompt_token_total"}
    assert _unknown("flotilla:tenant_cost_per_hours > 0", known_series) == {"flotilla:tenant_cost_per_hours"}


def test_referenced_series_leaves_out_functions_labels_numbers_and_strings():
    expr = (
        'histogram_quantile(0.95, sum by (namespace, le) (rate(a_bucket{x="y:z"}[5m])))\n'
        "/ on (namespace) group_left () (1e6 * b:c:d > bool 0) or up unless absent(e) and scalar(hour())"
    )
    assert rules.referenced_series(expr) == {"a_bucket", "b:c:d", "up", "e"}


def test_every_operator_series_is_named_in_the_contract():
    """The operator spells no series name of its own: each is a contract constant the rules can import."""
    from prometheus_client import REGISTRY

    contract_names = {v for k, v in vars(contract).items() if k.isupper() and isinstance(v, str)}
    operator = {f.name for f in REGISTRY.collect() if f.name.startswith("flotilla_")}
    assert operator and operator <= contract_names, operator - contract_names


@pytest.mark.parametrize("rule", [*rules.records(), *rules.alerts()], ids=lambda r: r.name)
def test_no_rule_keeps_a_per_request_label(rule, bounded_labels):
    labels = rules.grouping_labels(rule.expr)
    assert labels <= bounded_labels, f"{rule.name} groups by {labels - bounded_labels}"
    assert "without" not in rule.expr and "ignoring" not in rule.expr, (
        "keep labels by name, never by omission"
    )


def test_every_alert_has_a_runbook_a_severity_and_a_summary():
    for alert in rules.alerts():
        assert alert.severity in ("warning", "critical")
        assert alert.summary and alert.description and alert.runbook and "\n" not in alert.runbook


_COMPARISON = re.compile(r"\s(?:==|!=|>=|<=|>|<)\s+(?!bool\b)")


def test_every_alert_signal_is_its_own_expression_without_the_filter():
    """The signal is the alert's expression with `bool` on its comparisons (or what absent() reads), so it
    has a series whenever the alert's inputs exist, firing or not."""
    for alert in rules.alerts():
        assert alert.signal.replace(" bool", "") in alert.expr, alert.name
        assert not _COMPARISON.search(alert.signal), f"{alert.name}: a comparison without bool filters"
        assert alert.signal.replace(" bool", "") == alert.expr or alert.expr.startswith("absent("), alert.name
    assert "signal" not in rules.render()  # the rules file carries only what Prometheus reads


def test_the_comparison_check_tells_a_filter_from_a_bool():
    assert _COMPARISON.search("a > 0") and _COMPARISON.search("a == on (x) b")
    assert not _COMPARISON.search("a > bool 0") and not _COMPARISON.search('a{le=~"1"} >= bool on (x) b')


def test_promtool_parses_every_alert_signal(tmp_path, promtool):
    groups = [
        {
            "name": "signals",
            "rules": [{"record": f"flotilla_signal:{a.name}", "expr": a.signal} for a in rules.alerts()],
        }
    ]
    path = tmp_path / "signals.yaml"
    path.write_text(manifest_yaml.dump({"groups": groups}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_rules(promtool):
    result = subprocess.run(
        [promtool, "check", "rules", str(RULES_FILE)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass(promtool):
    result = subprocess.run(
        [promtool, "test", "rules", str(ALERTS_TEST)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _alert_cases() -> list[dict]:
    return yaml.safe_load(ALERTS_TEST.read_text())["tests"]


def test_every_alert_has_a_case_that_fires_it_and_one_that_must_not():
    alerts = {a.name for a in rules.alerts()}
    fires, quiet = set(), set()
    for case in _alert_cases():
        checks = case.get("alert_rule_test") or []
        for check in checks:
            assert check["alertname"] in alerts, f"{case['name']}: no alert {check['alertname']}"
            if check.get("exp_alerts"):
                fires.add(check["alertname"])
                for expected in check["exp_alerts"]:
                    assert set(expected["exp_annotations"]) == {"summary", "description", "runbook"}
                    assert "severity" in expected["exp_labels"]
        # A quiet case: a test of its own whose every check of the alert expects nothing.
        named = {c["alertname"] for c in checks}
        quiet.update(n for n in named if not any(c.get("exp_alerts") for c in checks if c["alertname"] == n))
    assert fires == alerts, f"no firing case for {alerts - fires}"
    assert quiet == alerts, f"no quiet case for {alerts - quiet}"


def test_the_recording_rule_cases_check_recorded_series():
    exprs = [t["expr"] for case in _alert_cases() for t in case.get("promql_expr_test") or []]
    checked = {name for expr in exprs for name in rules.referenced_series(expr)}
    assert checked <= RECORDED, checked - RECORDED
    for name in (
        rules.TENANT_COST_PER_HOUR,
        rules.SERVICE_TTFT_P95,
        rules.SERVICE_TTFT_SLO,
        rules.TENANT_IDLE_GPU_RATIO,
    ):
        assert name in checked
