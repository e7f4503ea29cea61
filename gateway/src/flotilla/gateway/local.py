"""`flotilla gateway run` as a subprocess on the local cluster, for the e2e tests and chaos cases (the chart
runs it as a pod; this runs it on the host, under its own ServiceAccount's token)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from flotilla.cluster.handle import ClusterHandle, free_port, wait_for
from flotilla.contract import FLAG_HOST, FLAG_PORT, HEALTH_PATH
from flotilla.gateway.rbac import SERVICE_ACCOUNT, render


def service_account_token(cluster: ClusterHandle, namespace: str) -> str:
    """Applies the gateway's least-privilege RBAC in `namespace` and returns a token of its ServiceAccount
    (two hours), for a gateway run on the host as the chart would run it in a pod."""
    cluster.kubectl("apply", "-f", "-", input=render(namespace))
    return cluster.kubectl(
        "create", "token", SERVICE_ACCOUNT, "-n", namespace, "--duration=2h"
    ).stdout.strip()


class GatewayProcess:
    def __init__(
        self, kubeconfig: Path, log_path: Path, keys_namespace: str, engine_token_file: Path
    ) -> None:
        self.kubeconfig, self.log_path = kubeconfig, log_path
        self.keys_namespace, self.engine_token_file = keys_namespace, engine_token_file
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> None:
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flotilla.cli", "gateway", "run", "--kubeconfig", str(self.kubeconfig),
                 FLAG_HOST, "127.0.0.1", FLAG_PORT, str(self.port), "--keys-namespace", self.keys_namespace,
                 "--engine-token-file", str(self.engine_token_file), "--hold-timeout", "300"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_for(self.healthy, timeout, f"the gateway's /health (log: {self.log_path})")

    def healthy(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, f"the gateway exited; see {self.log_path}"
        try:
            return httpx.get(self.url + HEALTH_PATH, timeout=2, trust_env=False).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
