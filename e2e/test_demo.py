"""`flotilla demo` (the end of `make demo`) on the tests' cluster: it must end with a Ready
InferenceService that answered one completion, and leave an operator that `cluster down` would stop."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flotilla.cluster.handle import ClusterHandle
from flotilla.cluster.processes import ProcessTable

pytestmark = pytest.mark.cluster


def test_demo_ends_with_a_ready_service_answering_a_completion(cluster: ClusterHandle):
    table = ProcessTable(cluster.config.state_dir / "pids")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "flotilla.cli", "demo", "--state-dir", str(cluster.config.state_dir),
             "--timeout", "300"],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "text: '" in result.stdout and "usage: " in result.stdout, result.stdout
        # Token metering end to end: the operator read the engine pod's counters into the Tenant.
        tenant = cluster.get_json("tenant", "demo-team")["status"]
        assert tenant["tokens"]["output"] >= 12 and tenant["tokens"]["input"] > 0, tenant
        assert "tokens in" in result.stdout, result.stdout
        ready = cluster.kubectl(
            "get", "fisvc", "tiny-chat", "-n", "demo", "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}"
        ).stdout  # fmt: skip
        assert ready == "True"
        assert table.running("operator") is not None, "the demo's operator should outlive the demo"
    finally:
        table.stop("operator")
        cluster.kubectl("delete", "namespace", "demo", "--wait=false", check=False)
        cluster.kubectl("delete", "tenant", "demo-team", "--ignore-not-found", "--wait=false", check=False)
