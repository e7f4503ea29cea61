"""The rule groups, in the rules file's order, and the recording rules and alerts they hold."""

from __future__ import annotations

from flotilla.monitoring.rules.alerting import ALERTS
from flotilla.monitoring.rules.model import Alert, Group, Record
from flotilla.monitoring.rules.operator import OPERATOR_RULES
from flotilla.monitoring.rules.service import SERVICE_RULES
from flotilla.monitoring.rules.tenant import TENANT_RULES

GROUPS = (
    Group("flotilla-service", SERVICE_RULES),
    Group("flotilla-tenant", TENANT_RULES),
    Group("flotilla-operator", OPERATOR_RULES),
    Group("flotilla-alerts", ALERTS),
)


def records() -> list[Record]:
    return [r for g in GROUPS for r in g.rules if isinstance(r, Record)]


def alerts() -> list[Alert]:
    return [r for g in GROUPS for r in g.rules if isinstance(r, Alert)]
