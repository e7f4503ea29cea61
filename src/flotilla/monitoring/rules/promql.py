"""Reading PromQL: the series an expression reads and the labels it groups by (for the tests, which
check each against what the project exports)."""

from __future__ import annotations

import re

PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
PROMETHEUS_SERIES = {"up"}  # what Prometheus itself records per target


def referenced_series(expr: str) -> set[str]:
    """The series names a PromQL expression reads (functions, keywords, labels and numbers left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?", "", text)  # numbers
    found = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", text):
        if re.match(r"\s*\(", text[match.end() :]) or match.group() in PROMQL_KEYWORDS:
            continue
        found.add(match.group())
    return found


def grouping_labels(expr: str) -> set[str]:
    """The labels an expression aggregates or matches by (by, without, on, ignoring, group_left/right)."""
    found = set()
    for match in re.finditer(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        found.update(label.strip() for label in match.group(1).split(",") if label.strip())
    return found
