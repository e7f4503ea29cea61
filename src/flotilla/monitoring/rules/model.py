"""What a rule is (a recording rule, an alert, a group of them) and the PromQL pieces the rules share.

Divisions are guarded the way vLLM's dashboards do it (`x / (y > 0)`): no traffic gives no series, never
NaN, and a quantile of no requests is no series either."""

from __future__ import annotations

from dataclasses import dataclass

from flotilla import contract as c
from flotilla.monitoring.rules.names import RATE_WINDOW, SERVICE_BY


@dataclass(frozen=True)
class Record:
    name: str
    expr: str
    doc: str  # a comment above the rule in the rendered file


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str  # "" fires at once
    severity: str  # "warning" | "critical"
    summary: str
    description: str
    runbook: str  # one line: what to look at and what to do
    # What the alert watches, with a series whenever its inputs exist, firing or not: the expression with
    # `bool` on each comparison (0 or 1 per matched pair), or what absent() reads. A healthy fleet fires no
    # alert, but it must give every signal a series (e2e/test_governance.py evaluates them live), so that a
    # quiet alert is told apart from one whose expression can never match. Not in the rules file.
    signal: str


@dataclass(frozen=True)
class Group:
    name: str
    rules: tuple[Record | Alert, ...]


def rate(name: str, window: str = RATE_WINDOW, selector: str = "") -> str:
    return f"rate({name}{selector}[{window}])"


def quantile(q: float, histogram: str, by: str = SERVICE_BY) -> str:
    """histogram_quantile over the rate window, only where requests were observed (no NaN)."""
    return (
        f"histogram_quantile({q},\n"
        f"  sum by ({by}, {c.LABEL_LE}) ({rate(histogram + '_bucket')})\n"
        f"  and on ({by}) (sum by ({by}) ({rate(histogram + '_count')}) > 0)\n"
        ")"
    )


# The engines' token counters, and the selector of the engines a Tenant owns.
PROMPT = c.counter_total(c.PROMPT_TOKENS)
GENERATION = c.counter_total(c.GENERATION_TOKENS)
HAS_TENANT = f'{{{c.LABEL_TENANT}!=""}}'  # engines outside any Tenant's namespaces export tenant=""
