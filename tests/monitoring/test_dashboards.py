"""The Grafana dashboards: the checked-in files are the generator's output, every query reads only series
the project exports or records and parses as PromQL, every variable a query uses is defined, each
dashboard has the variables its series allow, panels are numbered and laid out without overlap, the
ConfigMaps carry the sidecar's label, and no query keeps a per-request label."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flotilla import contract, manifest_yaml
from flotilla.cli import main
from flotilla.monitoring import dashboards, grafana, rules

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS_DIR = ROOT / "deploy" / "monitoring" / "dashboards"
BOARDS = dashboards.dashboards()
BY_UID = {b["uid"]: b for b in BOARDS}

# The template variables each dashboard offers: those whose label its series carry.
VARIABLES = {
    dashboards.SERVICE_UID: {"tenant", "namespace", "service", "model"},
    dashboards.TENANT_UID: {"tenant", "namespace", "service"},
    dashboards.FLEET_UID: {"tenant", "namespace"},
}
# Besides the rules' labels, a panel may split by these fixed or bounded sets (a served model name, token
# and scale directions, finish reasons, the operator's API verbs and resources).
PANEL_LABELS = {
    contract.LABEL_MODEL,
    contract.LABEL_DIRECTION,
    contract.LABEL_FINISH_REASON,
    # The LoRA info gauge's adapters of running and of waiting requests, per engine: subsets of its
    # loaded adapters (bounded by --max-loras), one series per engine at a time.
    contract.LABEL_RUNNING_LORA_ADAPTERS,
    contract.LABEL_WAITING_LORA_ADAPTERS,
    "verb",
    "resource",
    contract.LABEL_CODE,  # an HTTP status the gateway answered
    contract.LABEL_LIMIT,  # requests | tokens
    contract.LABEL_ENVOY_CODE_CLASS,  # 1..5
}
_LABEL_VALUES = re.compile(r"^label_values\(([A-Za-z_:][\w:]*)(\{[^}]*\})?, *(\w+)\)$")


def _panel_params():
    return [pytest.param(b, p, id=f"{b['uid']}/{p['title']}") for b in BOARDS for p in grafana.panels(b)]


def _variables(board: dict) -> list[dict]:
    return [v for v in board["templating"]["list"] if v["type"] == "query"]


def test_the_generators_import_only_the_stdlib_yaml_the_contract_and_the_rules():
    allowed = {
        "yaml",
        "flotilla.contract",
        "flotilla.manifest_yaml",
        "flotilla.monitoring.rules",
        "flotilla.monitoring.grafana",
    }
    # grafana.py, and each module of the dashboards package (which may import the others).
    paths = [Path(str(grafana.__file__)), *sorted(Path(str(dashboards.__file__)).parent.glob("*.py"))]
    for path in paths:
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {
            f"{n.module}.{a.name}" if n.module in ("flotilla", "flotilla.monitoring") else str(n.module)
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            for a in n.names
        }
        others = {
            m
            for m in imported
            if m.split(".")[0] not in sys.stdlib_module_names
            and m != dashboards.__name__
            and not m.startswith(f"{dashboards.__name__}.")
        }
        assert others <= allowed, (path.name, others - allowed)


def test_the_checked_in_dashboards_are_the_generators_output():
    wanted = dashboards.files()
    on_disk = {p.name for p in DASHBOARDS_DIR.iterdir()}
    assert on_disk == set(wanted), "run `flotilla monitoring dashboards`"
    for name, text in wanted.items():
        assert (DASHBOARDS_DIR / name).read_text() == text, f"{name}: run `flotilla monitoring dashboards`"


def test_the_dashboards_command_writes_and_checks(tmp_path, capsys):
    out = tmp_path / "dashboards"
    assert main(["monitoring", "dashboards", "--check", "--out-dir", str(out)]) == 1
    assert f"out of date: {out / 'configmaps.yaml'}" in capsys.readouterr().out
    assert main(["monitoring", "dashboards", "--out-dir", str(out)]) == 0
    assert main(["monitoring", "dashboards", "--check", "--out-dir", str(out)]) == 0
    capsys.readouterr()

    stale = out / f"{dashboards.FLEET_UID}.json"
    stale.write_text(stale.read_text().replace("Flotilla / Fleet", "Fleet"))
    (out / "renamed.json").write_text("{}\n")
    assert main(["monitoring", "dashboards", "--check", "--out-dir", str(out)]) == 1
    said = capsys.readouterr().out.splitlines()
    assert said == [
        f"out of date: {stale} (run `flotilla monitoring dashboards`)",
        f"out of date: {out / 'renamed.json'} (run `flotilla monitoring dashboards`)",
    ]


def test_the_rules_command_still_works(tmp_path):
    out = tmp_path / "rules.yaml"
    assert main(["monitoring", "rules", "--out", str(out)]) == 0
    assert main(["monitoring", "rules", "--check", "--out", str(out)]) == 0


def test_the_rendering_is_deterministic_and_sorted():
    for board in BOARDS:
        text = grafana.render(board)
        assert text == grafana.render(dashboards.dashboards()[BOARDS.index(board)])
        assert json.loads(text) == board
        assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
        assert board["schemaVersion"] == grafana.SCHEMA_VERSION


def test_uids_and_titles_are_unique():
    assert len(BY_UID) == len(BOARDS) == 3
    assert len({b["title"] for b in BOARDS}) == len(BOARDS)
    for board in BOARDS:
        titles = [p["title"] for p in grafana.panels(board)]
        assert len(titles) == len(set(titles)), f"{board['uid']}: a panel title twice"


def test_panel_ids_are_unique_and_the_layout_fits_the_grid():
    for board in BOARDS:
        ids = [p["id"] for p in board["panels"]]
        assert ids == list(range(1, len(ids) + 1)), board["uid"]
        taken: set[tuple[int, int]] = set()
        for panel in board["panels"]:
            pos = panel["gridPos"]
            assert 0 <= pos["x"] <= grafana.GRID_COLUMNS - pos["w"], panel["title"]
            cells = {
                (x, y)
                for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])
            }
            assert not cells & taken, f"{board['uid']}: {panel['title']} overlaps another panel"
            taken |= cells


@pytest.mark.parametrize(("board", "panel"), _panel_params())
def test_every_panel_has_a_title_a_description_and_the_datasource_variable(board, panel):
    assert panel["title"].strip() and panel["description"].strip()
    assert panel["type"] in ("timeseries", "stat", "gauge", "table", "bargauge")
    assert panel["datasource"] == grafana.DATASOURCE
    assert panel["targets"] and all(t["datasource"] == grafana.DATASOURCE for t in panel["targets"])
    assert [t["refId"] for t in panel["targets"]] == [chr(ord("A") + i) for i in range(len(panel["targets"]))]


@pytest.mark.parametrize(("board", "panel"), _panel_params())
def test_every_query_reads_only_series_the_project_exports_or_records(board, panel, known_series):
    for t in panel["targets"]:
        read = rules.referenced_series(t["expr"])
        assert read, f"{panel['title']}: a query that reads nothing: {t['expr']}"
        assert read <= known_series, f"{panel['title']} reads series nothing exports: {read - known_series}"


def test_a_misspelled_series_in_a_panel_is_caught(known_series):
    typo = f"sum by (tenant) (flotilla_tenant_gpu_quotas{dashboards.sel('tenant')}[$__range])"
    typo += f" / {rules.TENANT_GPU_QUOTA}{dashboards.sel('tenant')}"
    assert rules.referenced_series(typo) - known_series == {"flotilla_tenant_gpu_quotas"}


@pytest.mark.parametrize(
    "typo",
    [
        "flotilla_gateway_request_total",
        "envoy_cluster_upstream_rq_retries",
        "envoy_http_downstream_rq_actives",
    ],
)
def test_a_gateway_or_envoy_series_nobody_emits_is_caught(known_series, typo):
    """The gateway row reads the gateway's registry and the Envoy series the contract lists (each checked
    against a real Envoy in tests/gateway/test_envoy_stats.py); a name neither has fails the panel check."""
    assert {contract.ENVOY_DOWNSTREAM_RQ, contract.ENVOY_UPSTREAM_RQ_RETRY} <= known_series
    assert contract.counter_total(contract.GATEWAY_REQUESTS) in known_series
    expr = f'sum(rate({typo}{{envoy_cluster_name="flotilla_engines"}}[1m]))'
    assert rules.referenced_series(expr) - known_series == {typo}


def test_the_fleet_dashboard_has_the_gateway_row_over_the_picker_and_envoy():
    fleet = BY_UID[dashboards.FLEET_UID]
    rows = [p["title"] for p in fleet["panels"] if p["type"] == "row"]
    assert rows == ["GPUs", "Services", "Gateway", "Operator"]
    exprs = "\n".join(t["expr"] for p in grafana.panels(fleet) for t in p["targets"])
    read = rules.referenced_series(exprs)
    assert read >= contract.ENVOY_SERIES  # every Envoy series the contract lists is on a panel
    assert {contract.counter_total(contract.GATEWAY_REQUESTS), contract.GATEWAY_HELD_REQUESTS} <= read
    # Envoy's client series only: never the stats listener's (Prometheus's own scrapes).
    assert 'envoy_http_conn_manager_prefix="flotilla"' in exprs and "flotilla_stats" not in exprs


def test_every_variable_lists_the_values_of_a_known_series(known_series, bounded_labels):
    for board in BOARDS:
        for var in _variables(board):
            match = _LABEL_VALUES.match(var["query"])
            assert match, f"{board['uid']}: ${var['name']} is not label_values(<series>, <label>)"
            series, _, label = match.groups()
            assert series in known_series, f"{board['uid']}: ${var['name']} lists {series}"
            assert label == var["name"] and label in bounded_labels | PANEL_LABELS
            assert var["datasource"] == grafana.DATASOURCE and var["definition"] == var["query"]
        datasource = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
        assert [(v["name"], v["query"]) for v in datasource] == [(grafana.DATASOURCE_VARIABLE, "prometheus")]


def test_every_dashboard_has_the_variables_its_series_allow():
    for uid, wanted in VARIABLES.items():
        assert {v["name"] for v in _variables(BY_UID[uid])} == wanted, uid


def test_every_variable_a_query_uses_is_defined_and_every_variable_is_used():
    for board in BOARDS:
        defined = {v["name"] for v in board["templating"]["list"]}
        used_by_panels: set[str] = set()
        for panel in grafana.panels(board):
            for t in panel["targets"]:
                used = grafana.used_variables(t["expr"])
                assert used <= defined | set(dashboards.BUILTINS), (panel["title"], used - defined)
                used_by_panels |= used
        for var in _variables(board):
            assert grafana.used_variables(var["query"]) <= defined, var["name"]
        assert set(VARIABLES[board["uid"]]) <= used_by_panels, board["uid"]


def _balanced(expr: str) -> bool:
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def test_panel_queries_substitutes_every_variable():
    values = {"tenant": "team-a", "namespace": "ns-a", "service": "chat", "model": "tiny"}
    found = dashboards.panel_queries(values)
    assert len(found) == sum(len(p["targets"]) for b in BOARDS for p in grafana.panels(b))
    assert {uid for uid, _, _ in found} == set(BY_UID)
    for uid, title, expr in found:
        assert "$" not in expr, (uid, title, expr)
        assert _balanced(expr), (uid, title, expr)
        assert "[$__" not in expr
    exprs = "\n".join(e for _, _, e in found)
    assert 'tenant=~"team-a"' in exprs and 'model=~"tiny"' in exprs and 'service=~"chat"' in exprs
    assert "[1m]" in exprs and "[1h]" in exprs
    everything = "\n".join(e for _, _, e in dashboards.panel_queries({}))
    assert 'namespace=~".*"' in everything  # a variable not given matches every value


def test_every_query_parses_as_promql(tmp_path, promtool):
    """promtool parses each query (variables substituted) as a recording rule's expression."""
    queries = dashboards.panel_queries({})
    groups = [
        {
            "name": "dashboards",
            "rules": [
                {"record": f"flotilla_dashboard:query_{i}", "expr": expr}
                for i, (_, _, expr) in enumerate(queries)
            ],
        }
    ]
    path = tmp_path / "queries.yaml"
    path.write_text(manifest_yaml.dump({"groups": groups}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("board", "panel"), _panel_params())
def test_no_panel_keeps_a_per_request_label(board, panel, bounded_labels):
    allowed = bounded_labels | PANEL_LABELS
    for t in panel["targets"]:
        labels = rules.grouping_labels(t["expr"])
        assert labels <= allowed, f"{panel['title']} groups by {labels - allowed}"
        assert "without" not in t["expr"] and "ignoring" not in t["expr"]
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t["legendFormat"]))
        assert legend <= allowed, f"{panel['title']} names {legend - allowed} in its legend"


def test_the_rules_names_are_read_where_a_rule_records_them():
    """One source: the latency percentiles, the per-service and per-tenant figures come from the rules;
    no panel computes a quantile of an engine histogram itself."""
    exprs = "\n".join(e for _, _, e in dashboards.panel_queries({}))
    for histogram in (
        contract.TIME_TO_FIRST_TOKEN,
        contract.INTER_TOKEN_LATENCY,
        contract.E2E_REQUEST_LATENCY,
    ):
        assert histogram not in exprs
    read = set().union(*(rules.referenced_series(e) for _, _, e in dashboards.panel_queries({})))
    recorded = {r.name for r in rules.records()}
    assert len(read & recorded) >= 30, sorted(recorded - read)


def test_the_configmaps_carry_the_sidecar_label_and_the_dashboards():
    maps = list(yaml.safe_load_all((DASHBOARDS_DIR / dashboards.CONFIGMAPS_FILE).read_text()))
    assert [m["kind"] for m in maps] == ["ConfigMap"] * len(BOARDS)
    for m, board in zip(maps, BOARDS, strict=True):
        meta = m["metadata"]
        assert meta["labels"][grafana.SIDECAR_LABEL] == "1"
        assert meta["namespace"] == dashboards.CONFIGMAP_NAMESPACE == "flotilla-system"
        assert list(m["data"]) == [f"{board['uid']}.json"]
        assert json.loads(m["data"][f"{board['uid']}.json"]) == board
        assert m["data"][f"{board['uid']}.json"] == (DASHBOARDS_DIR / f"{board['uid']}.json").read_text()
