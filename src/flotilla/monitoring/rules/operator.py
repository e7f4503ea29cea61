"""The operator's recording rules: admission refusals, reconcile errors and reconcile latency."""

from __future__ import annotations

from flotilla import contract as c
from flotilla.monitoring.rules.model import Record, rate
from flotilla.monitoring.rules.names import ADMISSION_DENIALS, RECONCILE_ERRORS, RECONCILE_P99

OPERATOR_RULES = (
    Record(
        ADMISSION_DENIALS,
        f"sum by ({c.LABEL_TENANT}, {c.LABEL_REASON}) ({rate(c.counter_total(c.ADMISSION_DENIALS))})",
        "admission refusals per second",
    ),
    Record(
        RECONCILE_ERRORS,
        f"sum by ({c.LABEL_TRIGGER}) ({rate(c.counter_total(c.RECONCILE_ERRORS))})",
        "reconciles that raised, per second",
    ),
    Record(
        RECONCILE_P99,
        f"histogram_quantile(0.99,\n"
        f"  sum by ({c.LABEL_LE}) ({rate(c.RECONCILE_DURATION + '_bucket')})\n"
        f"  and on () (sum({rate(c.RECONCILE_DURATION + '_count')}) > 0)\n"
        ")",
        "reconcile duration p99; none without reconciles",
    ),
)
