"""A handle on a running local cluster (kubectl with its kubeconfig), and polling with a clear failure."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from flotilla.cluster.control_plane import ClusterConfig, kubectl_path

T = TypeVar("T")


@dataclass
class ClusterHandle:
    config: ClusterConfig
    started_here: bool

    @property
    def kubeconfig(self) -> Path:
        return self.config.kubeconfig

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [str(kubectl_path()), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}"
            )
        return result

    def get_json(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, manifest: str, namespace: str | None = None) -> subprocess.CompletedProcess:
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=manifest)

    def apply_once_admitted(self, manifest: str, timeout: float, what: str) -> None:
        """Applies `manifest` as soon as the admission webhook answers: an operator that just started
        serves its webhook moments later, and with failurePolicy Fail every write fails until then."""
        wait_for(
            lambda: self.kubectl("apply", "-f", "-", input=manifest, check=False).returncode == 0,
            timeout,
            what,
        )


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.5) -> T:
    """Polls until predicate returns something truthy; fails naming what was awaited and the last value."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except AssertionError as exc:
            last = exc
        else:
            if last:
                return last  # type: ignore[return-value]
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
