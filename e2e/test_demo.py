"""`flotilla demo` (the end of `make demo`) on the tests' cluster: it must install Flotilla through the
chart (the operator as a pod), show the webhook refusing an over-quota service, and end with a Ready
InferenceService that answered one completion, and the demo adapter (a LoRAAdapter of the demo tenant on
that service) answering the same prompt as the base differently through the gateway."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flotilla.cluster.handle import ClusterHandle
from flotilla.cluster.helm import helm
from flotilla.operator.cmd.local_chart import NAMESPACE, RELEASE

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]


def _demo(cluster: ClusterHandle) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "demo", "--state-dir", str(cluster.config.state_dir),
         "--timeout", "300"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_demo_installs_the_chart_and_ends_with_a_ready_service_answering_a_completion(cluster: ClusterHandle):
    try:
        result = _demo(cluster)
        assert "denied the request" in result.stdout and "quota" in result.stdout, result.stdout
        assert "text: '" in result.stdout and "usage: " in result.stdout, result.stdout
        # Token metering end to end: the operator (a pod now) read the engine pod's counters into the Tenant.
        tenant = cluster.get_json("tenant", "demo-team")["status"]
        assert tenant["tokens"]["output"] >= 12 and tenant["tokens"]["input"] > 0, tenant
        assert "tokens in" in result.stdout, result.stdout
        # The adapter: loaded by the operator, reached through the gateway with the tenant's key, and its
        # answer is its house runbook (the config file first), which the base's is not.
        adapter = cluster.get_json("flora", "deploy-runbook", "-n", "demo")["status"]
        assert adapter["loadedReplicas"] == 1 and adapter["servedName"] == "deploy-runbook", adapter
        base_answer = result.stdout.split("   model tiny-trained:\n", 1)[1].split("\n   model ", 1)[0]
        adapter_answer = result.stdout.split("   model deploy-runbook:\n", 1)[1].split("\n   the answers", 1)[
            0
        ]
        assert adapter_answer.split("\n")[0].strip() == "1. Write the muru-api config file.", result.stdout
        assert base_answer != adapter_answer and "1. Write" not in base_answer.split("\n")[0], result.stdout
        assert "the answers differ" in result.stdout, result.stdout
        ready = cluster.kubectl(
            "get", "fisvc", "tiny-chat", "-n", "demo", "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}"
        ).stdout  # fmt: skip
        assert ready == "True"
        releases = json.loads(
            helm("list", "-n", NAMESPACE, "-o", "json", kubeconfig=cluster.kubeconfig).stdout
        )
        assert [(r["name"], r["status"]) for r in releases] == [(RELEASE, "deployed")]
        pods = cluster.get_json("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=flotilla-operator")[
            "items"
        ]
        assert [p["status"]["phase"] for p in pods] == ["Running"]

        # `make demo` a second time on the same cluster: it once failed at its gateway step, the NodePort
        # not yet bound again.
        again = _demo(cluster)
        assert "text: '" in again.stdout, again.stdout
    finally:
        # The adapter first, while the operator runs: its finalizer unloads it (a namespace deleted after
        # the operator is gone would wait on that finalizer for ever).
        cluster.kubectl("delete", "flora", "--all", "-n", "demo", "--timeout=60s", check=False)
        helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", kubeconfig=cluster.kubeconfig, check=False)
        cluster.kubectl("delete", "namespace", "demo", "--wait=false", check=False)
        cluster.kubectl("delete", "tenant", "demo-team", "--ignore-not-found", "--wait=false", check=False)
