"""A Prometheus server (built from Go modules by `flotilla cluster build`) as a local process, on
127.0.0.1, for the tests that check metrics with the real thing."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

from flotilla import manifest_yaml
from flotilla.cluster.handle import free_port, wait_for
from flotilla.cluster.paths import prometheus_path

BINARY = prometheus_path()


class PrometheusProcess:
    """`with PrometheusProcess(config, workdir) as prom:` starts it, waits for /-/ready, and stops it."""

    def __init__(self, config: dict, workdir: Path):
        if not BINARY.exists():
            raise RuntimeError(f"{BINARY} is missing: run `flotilla cluster build` (make test does)")
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(manifest_yaml.dump(config))
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PrometheusProcess:
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [str(BINARY), f"--config.file={self.workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            wait_for(self._ready, 60, f"Prometheus to be ready (log: {self.log_path})")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, f"Prometheus exited; see {self.log_path}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as rsp:
                return rsp.status == 200
        except OSError:
            return False

    def __exit__(self, *_exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
