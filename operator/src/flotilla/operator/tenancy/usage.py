"""The usage report behind `flotilla usage`: Tenants' metering ledgers -> rows, in table, CSV or JSON.
Pure: the command (usage_cli.py) reads the Tenants and prints what this returns.

Without a window the report covers all time (the ledger's totals). With --since/--until it sums the
ledger's daily buckets, so a window is whole UTC days (inclusive) within the last 62 days.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field
from datetime import date

from flotilla.operator.api.v1alpha1 import TenantSpec, TenantStatus
from flotilla.operator.tenancy.metering import DAILY_RETENTION_DAYS


@dataclass(frozen=True)
class Row:
    tenant: str
    namespace: str
    service: str
    gpu_type: str
    gpu_seconds: float
    gpu_hours: float
    price_per_gpu_hour: float
    cost: float


@dataclass(frozen=True)
class AdapterRow:
    """One LoRAAdapter's tokens, all time, and their cost at the tenant's cost per million tokens."""

    tenant: str
    namespace: str
    adapter: str
    tokens_input: int
    tokens_output: int
    cost: float


@dataclass(frozen=True)
class TenantReport:
    tenant: str
    last_metered_time: str | None
    gpu_seconds: float
    cost: float
    tokens_input: int  # all time: engines' counters are not kept per day
    tokens_output: int
    cost_per_million_tokens: float | None  # all time, like the tokens
    rows: list[Row]
    adapters: list[AdapterRow] = field(default_factory=list)  # all time, like the tokens


class WindowError(ValueError):
    pass


def check_window(since: date | None, until: date | None, today: date) -> None:
    if since and until and since > until:
        raise WindowError(f"--since {since} is after --until {until}")
    if since and (today - since).days > DAILY_RETENTION_DAYS:
        raise WindowError(
            f"--since {since}: daily figures are kept for {DAILY_RETENTION_DAYS} days; "
            "omit --since and --until for all-time totals"
        )


def report(
    name: str, spec: TenantSpec, status: TenantStatus, since: date | None, until: date | None
) -> TenantReport:
    if since is None and until is None:
        entries = dict(status.ledger.total)
    else:
        entries: dict[str, float] = {}
        lo, hi = (since or date.min).isoformat(), (until or date.max).isoformat()
        for day, bucket in status.ledger.daily.items():
            if lo <= day <= hi:
                for key, seconds in bucket.items():
                    entries[key] = entries.get(key, 0.0) + seconds
    rows = []
    for key, seconds in sorted(entries.items()):
        namespace, service, gpu_type = key.split("/", 2)
        price = spec.price_per_gpu_hour.get(gpu_type, 0.0)
        rows.append(
            Row(name, namespace, service, gpu_type, round(seconds, 3), round(seconds / 3600, 6), price,
                round(seconds / 3600 * price, 6))
        )  # fmt: skip
    all_time_cost = sum(
        s / 3600 * spec.price_per_gpu_hour.get(key.rsplit("/", 1)[1], 0.0)
        for key, s in status.ledger.total.items()
    )
    tokens = status.tokens.input + status.tokens.output
    per_million = all_time_cost / tokens * 1e6 if tokens else 0.0
    return TenantReport(
        tenant=name,
        last_metered_time=status.last_metered_time,
        gpu_seconds=round(sum(r.gpu_seconds for r in rows), 3),
        cost=round(sum(r.cost for r in rows), 6),
        tokens_input=status.tokens.input,
        tokens_output=status.tokens.output,
        cost_per_million_tokens=round(all_time_cost / tokens * 1e6, 6) if tokens else None,
        rows=rows,
        adapters=[
            AdapterRow(
                tenant=name,
                namespace=key.split("/", 1)[0],
                adapter=key.split("/", 1)[-1],
                tokens_input=u.input,
                tokens_output=u.output,
                cost=round((u.input + u.output) * per_million / 1e6, 6),
            )
            for key, u in sorted(status.adapters.items())
        ],
    )


COLUMNS = [
    "tenant",
    "namespace",
    "service",
    "gpu_type",
    "gpu_seconds",
    "gpu_hours",
    "price_per_gpu_hour",
    "cost",
]


ADAPTER_COLUMNS = ["tenant", "namespace", "adapter", "tokens_input", "tokens_output", "cost"]


def render(reports: list[TenantReport], fmt: str, window: dict) -> str:
    if fmt == "json":
        return json.dumps({"window": window, "tenants": [asdict(r) for r in reports]}, indent=2) + "\n"
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(COLUMNS)
        for r in reports:
            for row in r.rows:
                writer.writerow([getattr(row, c) for c in COLUMNS])
        if any(r.adapters for r in reports):
            writer.writerow([])
            writer.writerow(ADAPTER_COLUMNS)
            for r in reports:
                for a in r.adapters:
                    writer.writerow([getattr(a, c) for c in ADAPTER_COLUMNS])
        return out.getvalue()
    if fmt == "table":
        return _table(reports, window)
    raise ValueError(f"unknown format {fmt!r}: table, csv or json")


def _table(reports: list[TenantReport], window: dict) -> str:
    lines = [[c.upper().replace("_", " ") for c in COLUMNS]]
    for r in reports:
        for row in r.rows:
            lines.append([str(getattr(row, c)) for c in COLUMNS])
        lines.append(
            [
                r.tenant,
                "*",
                "*",
                "*",
                f"{r.gpu_seconds}",
                f"{round(r.gpu_seconds / 3600, 6)}",
                "",
                f"{r.cost}",
            ]
        )
    text = _aligned(lines)
    adapters = [[c.upper().replace("_", " ") for c in ADAPTER_COLUMNS]]
    adapters += [[str(getattr(a, c)) for c in ADAPTER_COLUMNS] for r in reports for a in r.adapters]
    if len(adapters) > 1:
        text += "\n\nLoRA adapters (all time; cost at the tenant's cost per million tokens)\n" + _aligned(
            adapters
        )
    span = f"{window.get('since') or 'the start'} .. {window.get('until') or 'now'}"
    notes = [f"window: {span} (UTC days)"]
    for r in reports:
        per_m = f"{r.cost_per_million_tokens}" if r.cost_per_million_tokens is not None else "n/a (no tokens)"
        notes.append(
            f"{r.tenant}: metered until {r.last_metered_time or 'never'}; tokens in {r.tokens_input}, "
            f"out {r.tokens_output}; cost per million tokens (all time) {per_m}"
        )
    return text + "\n\n" + "\n".join(notes) + "\n"


def _aligned(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )
