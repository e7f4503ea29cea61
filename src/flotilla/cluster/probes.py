"""HTTP, TCP and exec probes with the kubelet's timing rules (delay, period, thresholds)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx


def run_probe(
    probe: dict, pod_ip: str, container_ports: list[dict], env: dict[str, str] | None = None
) -> bool:
    """One probe. `env`: the container's environment, which an exec probe runs in (as in a container)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    if "httpGet" in probe:
        spec = probe["httpGet"]
        port = _port(spec["port"], container_ports)
        host = spec.get("host") or pod_ip
        scheme = spec.get("scheme", "HTTP").lower()
        headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
        try:
            response = httpx.get(
                f"{scheme}://{host}:{port}{spec.get('path', '/')}",
                headers=headers,
                timeout=timeout,
                verify=False,
            )
        except httpx.HTTPError:
            return False
        return 200 <= response.status_code < 400
    if "tcpSocket" in probe:
        port = _port(probe["tcpSocket"]["port"], container_ports)
        try:
            with socket.create_connection((probe["tcpSocket"].get("host") or pod_ip, port), timeout=timeout):
                return True
        except OSError:
            return False
    if "exec" in probe:
        try:
            return (
                subprocess.run(
                    probe["exec"]["command"], timeout=timeout, capture_output=True, env=env
                ).returncode
                == 0
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
    return True


def _port(value, container_ports: list[dict]) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for port in container_ports:
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ValueError(f"probe names port {value!r}, which the container does not declare")


@dataclass
class ProbeTracker:
    """Consecutive successes and failures of one probe on one container run.

    `started_at` and every `now` come from `clock` (monotonic seconds, whatever its origin): the first run
    is due at the initial delay, the next ones a period after the last ran, as a kubelet runs them.
    """

    probe: dict
    started_at: float
    successes: int = 0
    failures: int = 0
    last_run: float | None = None  # None until the first run: no period to wait for yet
    result: bool | None = None  # None until the threshold settles it
    running: bool = field(default=False)
    clock: Callable[[], float] = time.monotonic

    def due(self, now: float) -> bool:
        if self.running or now < self.started_at + float(self.probe.get("initialDelaySeconds", 0)):
            return False
        return self.last_run is None or now - self.last_run >= float(self.probe.get("periodSeconds", 10))

    def record(self, ok: bool) -> None:
        self.running = False
        self.last_run = self.clock()
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.probe.get("successThreshold", 1)):
                self.result = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= int(self.probe.get("failureThreshold", 3)):
                self.result = False
