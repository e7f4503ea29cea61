"""What the three dashboards share: the labels of their template variables, the selectors that filter
by them, and Grafana's rate and increase over its own intervals."""

from __future__ import annotations

from flotilla import contract as c
from flotilla.monitoring.rules import names as r

TENANT, NAMESPACE, SERVICE, MODEL = c.LABEL_TENANT, c.LABEL_NAMESPACE, c.LABEL_SERVICE, c.LABEL_MODEL
NS_SVC = "{{namespace}}/{{service}}"


def sel(*labels: str) -> str:
    """A selector filtering each label by its template variable: `{namespace=~"$namespace", ...}`."""
    return "{" + ", ".join(f'{label}=~"${label}"' for label in labels) + "}"


def rate(series: str, selector: str, window: str = "$__rate_interval") -> str:
    return f"rate({series}{selector}[{window}])"


def increase(series: str, selector: str, window: str = "$__range") -> str:
    return f"increase({series}{selector}[{window}])"


SVC = sel(NAMESPACE, SERVICE)  # the per-service rules and the operator's per-service series
BY_SERVICE = r.SERVICE_BY  # the per-service rules' key
TEN = sel(TENANT)  # the per-tenant rules and the operator's tenant series
