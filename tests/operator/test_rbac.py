from __future__ import annotations

from pathlib import Path

from flotilla.operator.api import inference_extension as gie
from flotilla.operator.manifests.rbac import RULES, render

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "operator-rbac.yaml"


def test_checked_in_rbac_matches_the_rules():
    assert DEPLOY.read_text() == render("flotilla-system"), "run `flotilla operator rbac`"


def test_least_privilege():
    verbs = {(group, res): set(v) for group, resources, v, _ in RULES for res in resources}
    # The operator never deletes: garbage collection removes children through owner references.
    assert all("delete" not in v and "*" not in v for v in verbs.values())
    # patch: the metering finalizer on engine pods (added as they appear, removed once metered).
    assert verbs[("", "pods")] == {"get", "list", "watch", "patch"}
    assert "secrets" not in {res for _, res in verbs}
    # The InferencePools: applied and drift-corrected like the other children; status for its own entry.
    assert verbs[(gie.GROUP, gie.PLURAL)] == {"get", "list", "watch", "create", "patch"}
    assert verbs[(gie.GROUP, f"{gie.PLURAL}/status")] == {"get", "patch"}
