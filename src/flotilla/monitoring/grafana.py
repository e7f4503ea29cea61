"""Plain builders for Grafana dashboards: functions that return the JSON Grafana reads, as dicts.

A panel is built without an id or a position; `dashboard()` numbers the panels in order and lays them out
on Grafana's 24-column grid (left to right, a new line when a panel does not fit, a full-width header per
row), so the same Python always renders the same JSON (`render` sorts keys). Every query goes to the
Prometheus picked in the dashboard's `datasource` variable. Standard library and pyyaml only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from flotilla import manifest_yaml

SCHEMA_VERSION = 39
GRID_COLUMNS = 24
DATASOURCE_VARIABLE = "datasource"
DATASOURCE = {"type": "prometheus", "uid": f"${{{DATASOURCE_VARIABLE}}}"}
SIDECAR_LABEL = "grafana_dashboard"  # the label Grafana's dashboard sidecar looks for (value "1")
FOLDER_ANNOTATION = "grafana_folder"  # the folder it files a dashboard under, when configured to read it
ALL = ".*"  # a variable's "All" value, where it is a regex

Json = dict[str, Any]


def target(expr: str, legend: str = "") -> Json:
    """One PromQL query of a panel; `legend` is Grafana's legendFormat (`{{namespace}}/{{service}}`)."""
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto"}


def _panel(
    kind: str,
    title: str,
    description: str,
    targets: Iterable[Json],
    *,
    unit: str,
    width: int,
    height: int,
    instant: bool,
    options: Json,
    defaults: Json | None = None,
    time_from: str = "",
) -> Json:
    if not title or not description:
        raise ValueError("every panel has a title and a description")
    queries = []
    for ref, t in zip("ABCDEFGHIJKLMNOPQRSTUVWXYZ", targets, strict=False):
        # Instant panels (stat, gauge, bar gauge, table) ask for one value per series: now, or the end of
        # the panel's time range.
        queries.append(t | {"refId": ref, "instant": instant, "range": not instant})
    if not queries:
        raise ValueError(f"panel {title!r} has no query")
    panel: Json = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": queries,
        "gridPos": {"w": width, "h": height},
        "options": options,
        "fieldConfig": {"defaults": {"unit": unit, **(defaults or {})}, "overrides": []},
    }
    if time_from:
        panel["timeFrom"] = time_from  # a range of its own: "now/d" is today so far, "now/M" this month
    return panel


def thresholds(*steps: tuple[float, str], base: str = "green") -> Json:
    """Absolute thresholds: `base` below the first step, then each step's colour from its value up."""
    return {
        "mode": "absolute",
        "steps": [{"color": base, "value": None}, *({"color": c, "value": v} for v, c in steps)],
    }


def _defaults(
    min_: float | None, max_: float | None, decimals: int | None, steps: tuple[tuple[float, str], ...]
) -> Json:
    out: Json = {}
    if min_ is not None:
        out["min"] = min_
    if max_ is not None:
        out["max"] = max_
    if decimals is not None:
        out["decimals"] = decimals
    if steps:
        out["thresholds"] = thresholds(*steps)
        out["color"] = {"mode": "thresholds"}
    return out


_REDUCE = {"calcs": ["lastNotNull"], "fields": "", "values": False}


def timeseries(
    title: str,
    description: str,
    *targets: Json,
    unit: str = "short",
    width: int = 12,
    height: int = 8,
    min_: float | None = None,
    max_: float | None = None,
    decimals: int | None = None,
    bars: bool = False,
) -> Json:
    defaults = _defaults(min_, max_, decimals, ())
    defaults["custom"] = {"drawStyle": "bars" if bars else "line", "fillOpacity": 50 if bars else 10}
    options = {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return _panel(
        "timeseries", title, description, targets, unit=unit, width=width, height=height, instant=False,
        options=options, defaults=defaults,
    )  # fmt: skip


def stat(
    title: str,
    description: str,
    *targets: Json,
    unit: str = "short",
    width: int = 6,
    height: int = 5,
    decimals: int | None = None,
    steps: tuple[tuple[float, str], ...] = (),
    time_from: str = "",
) -> Json:
    options = {
        "reduceOptions": _REDUCE,
        "colorMode": "value",
        "graphMode": "none",
        "justifyMode": "auto",
        "orientation": "auto",
        "textMode": "auto",
    }
    return _panel(
        "stat", title, description, targets, unit=unit, width=width, height=height, instant=True,
        options=options, defaults=_defaults(None, None, decimals, steps), time_from=time_from,
    )  # fmt: skip


def gauge(
    title: str,
    description: str,
    *targets: Json,
    unit: str = "percentunit",
    width: int = 6,
    height: int = 8,
    min_: float = 0,
    max_: float = 1,
    steps: tuple[tuple[float, str], ...] = (),
) -> Json:
    options = {
        "reduceOptions": _REDUCE,
        "orientation": "auto",
        "showThresholdLabels": False,
        "showThresholdMarkers": True,
    }
    return _panel(
        "gauge", title, description, targets, unit=unit, width=width, height=height, instant=True,
        options=options, defaults=_defaults(min_, max_, None, steps),
    )  # fmt: skip


def bargauge(
    title: str,
    description: str,
    *targets: Json,
    unit: str = "short",
    width: int = 12,
    height: int = 8,
    decimals: int | None = None,
    time_from: str = "",
) -> Json:
    options = {
        "reduceOptions": _REDUCE,
        "displayMode": "gradient",
        "orientation": "horizontal",
        "showUnfilled": True,
    }
    return _panel(
        "bargauge", title, description, targets, unit=unit, width=width, height=height, instant=True,
        options=options, defaults=_defaults(0, None, decimals, ()), time_from=time_from,
    )  # fmt: skip


def table(
    title: str,
    description: str,
    columns: Mapping[str, Json],
    *,
    labels: Iterable[str],
    unit: str = "short",
    width: int = 24,
    height: int = 8,
    decimals: int | None = None,
) -> Json:
    """One row per label set: each column is one instant query (`{"Column title": target(...)}`), the
    rows are the queries' results merged on `labels`, which come first. Each query is taken
    `max by (<labels>)`, so that no other label (`__name__` above all) keeps a row from merging."""
    labels = list(labels)
    names = list(columns)
    by = ", ".join(labels)
    targets = [t | {"expr": f"max by ({by}) ({t['expr']})", "format": "table"} for t in columns.values()]
    panel = _panel(
        "table", title, description, targets, unit=unit, width=width, height=height, instant=True,
        options={"showHeader": True, "cellHeight": "sm"},
        defaults=_defaults(None, None, decimals, ()),
    )  # fmt: skip
    # Grafana names the merged value columns "Value #<refId>": give them the columns' titles.
    values = {f"Value #{t['refId']}": name for t, name in zip(panel["targets"], names, strict=True)}
    order = [*labels, *values]
    panel["transformations"] = [
        {"id": "merge", "options": {}},
        {
            "id": "organize",
            "options": {
                "excludeByName": {"Time": True},
                "indexByName": {name: i for i, name in enumerate(order)},
                "renameByName": values,
            },
        },
    ]
    return panel


def row(title: str, *panels: Json) -> tuple[str, tuple[Json, ...]]:
    """A titled group of panels; `dashboard()` turns it into Grafana's row header and lays out the panels."""
    return title, panels


def variable(name: str, label: str, series: str, selector: str = "", *, all_value: str | None = ALL) -> Json:
    """A multi-value variable listing the values of `name` on `series{selector}` (`label_values`).

    With `all_value=None`, "All" stands for the values the variable lists (so a chain of variables narrows
    it); otherwise for the regex given (`.*`: every value, also series the list query does not see)."""
    query = f"label_values({series}{selector}, {name})"
    out: Json = {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": query,
        "definition": query,
        "refresh": 2,  # on time range change: a value that appeared a minute ago is listed
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "current": {},
        "options": [],
        "hide": 0,
        "regex": "",
    }
    if all_value is not None:
        out["allValue"] = all_value
    return out


def datasource_variable() -> Json:
    """The Prometheus every query goes to; Grafana picks the default one until the user changes it."""
    return {
        "name": DATASOURCE_VARIABLE,
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "options": [],
        "hide": 0,
        "regex": "",
        "refresh": 1,
        "multi": False,
        "includeAll": False,
    }


def dashboard(
    uid: str,
    title: str,
    description: str,
    variables: Iterable[Json],
    rows: Iterable[tuple[str, tuple[Json, ...]]],
    *,
    tags: Iterable[str] = (),
    time_from: str = "now-6h",
) -> Json:
    """The dashboard: rows laid out top to bottom, panels numbered 1, 2, ... in order (rows included)."""
    panels: list[Json] = []
    y = 0
    for title_, members in rows:
        panels.append(
            {
                "type": "row",
                "title": title_,
                "collapsed": False,
                "panels": [],
                "gridPos": {"x": 0, "y": y, "w": GRID_COLUMNS, "h": 1},
            }
        )
        y += 1
        x, line = 0, 0
        for panel in members:
            w, h = panel["gridPos"]["w"], panel["gridPos"]["h"]
            if x + w > GRID_COLUMNS:
                x, y, line = 0, y + line, 0
            panels.append(panel | {"gridPos": {"x": x, "y": y, "w": w, "h": h}})
            x, line = x + w, max(line, h)
        y += line
    for i, panel in enumerate(panels, start=1):
        panel["id"] = i
    tags = ["flotilla", *tags]
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": tags,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,  # a shared crosshair
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "30s",
        "time": {"from": time_from, "to": "now"},
        "timepicker": {},
        # UTC, as the operator's metering: "today" and "this month" start when its day and month buckets do.
        "timezone": "utc",
        "weekStart": "",
        "annotations": {"list": []},
        "links": [
            {
                "type": "dashboards",
                "title": "Flotilla",
                "tags": ["flotilla"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": panels,
    }


def render(board: Json) -> str:
    """The dashboard's JSON file: sorted keys, two-space indents, a final newline."""
    return json.dumps(board, indent=2, sort_keys=True) + "\n"


def panels(board: Json) -> list[Json]:
    """The dashboard's panels, row headers left out."""
    return [p for p in board["panels"] if p["type"] != "row"]


def queries(board: Json) -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel."""
    return [(p["title"], t["expr"]) for p in panels(board) for t in p["targets"]]


_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def used_variables(text: str) -> set[str]:
    """The variables `$name`, `${name}` and `${name:format}` in a query."""
    return {a or b for a, b in _VARIABLE.findall(text)}


def substitute(text: str, values: Mapping[str, str]) -> str:
    """`text` with each `$name` / `${name}` replaced by `values[name]` (a KeyError names a missing one)."""
    return _VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)], text)


class _Dumper(manifest_yaml.Dumper):
    pass


def _str(dumper: manifest_yaml.Dumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def configmap(board: Json, namespace: str, folder: str = "") -> Json:
    """The dashboard as a ConfigMap that Grafana's dashboard sidecar loads (label grafana_dashboard: "1"),
    under the data key `<uid>.json`."""
    meta: Json = {
        "name": f"grafana-dashboard-{board['uid']}",
        "namespace": namespace,
        "labels": {SIDECAR_LABEL: "1", "app.kubernetes.io/part-of": "flotilla"},
    }
    if folder:
        meta["annotations"] = {FOLDER_ANNOTATION: folder}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {f"{board['uid']}.json": render(board)},
    }


def render_configmaps(maps: Iterable[Json], header: str = "") -> str:
    """ConfigMaps as one multi-document YAML file, each dashboard's JSON a literal block."""
    docs = [
        manifest_yaml.dump(
            m, Dumper=_Dumper, sort_keys=False, width=1000, explicit_start=True, allow_unicode=True
        )
        for m in maps
    ]
    return header + "".join(docs)
