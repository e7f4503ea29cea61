"""The operator on a local cluster: its CRDs and RBAC applied, a kubeconfig for its ServiceAccount, and
`flotilla operator run` as a subprocess. The demo, the scale benchmark and the e2e tests share it, so the
operator always runs under its least-privilege identity, never as admin."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle, free_port, wait_for
from flotilla.cluster.processes import ProcessTable

OPERATOR_NS = "flotilla-system"
OPERATOR_SA = "flotilla-operator"


def install_manifests(cluster: ClusterHandle) -> None:
    """The CRDs (server-side, so re-applying a newer schema wins) and the operator's RBAC, rendered from
    the same generators as crds/ and deploy/, so an installed operator needs no checkout."""
    from flotilla.operator.manifests.crds import crd_files
    from flotilla.operator.manifests.rbac import render

    crds = "---\n".join(crd_files().values())
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=crds)
    names = [f"crd/{name.removesuffix('.yaml')}" for name in crd_files()]
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *names)
    cluster.kubectl("apply", "-f", "-", input=render(OPERATOR_NS))


def kubeconfig_for(cluster: ClusterHandle, path: Path, user: dict) -> Path:
    """A kubeconfig for this cluster that authenticates as `user` (a token or a client certificate)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": cluster.config.server,
                    "certificate-authority": str(cluster.config.pki_dir / "ca.crt"),
                },
            }
        ],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "user"}}],
        "current-context": "local",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest_yaml.dump(config))
    return path


def service_account_kubeconfig(cluster: ClusterHandle, path: Path, duration: str = "24h") -> Path:
    token = cluster.kubectl(
        "create", "token", OPERATOR_SA, "-n", OPERATOR_NS, f"--duration={duration}"
    ).stdout.strip()
    return kubeconfig_for(cluster, path, {"token": token})


class OperatorProcess:
    """`flotilla operator run` as a subprocess: restartable, SIGKILL-able, with /healthz and /metrics."""

    def __init__(
        self,
        kubeconfig: Path,
        log_path: Path,
        extra_args: tuple[str, ...] = (),
        host_path_roots: tuple[Path | str, ...] = (),
    ):
        """`host_path_roots`: the folders whose file:// models and adapterDirs the operator may mount
        (--host-path-root; the folders a test writes its models and adapters into). Empty by default, as
        the operator's own default: every file:// model is then refused."""
        self.kubeconfig, self.log_path, self.extra_args = kubeconfig, log_path, extra_args
        self.host_path_roots = tuple(str(root) for root in host_path_roots)
        self.metrics_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def argv(self) -> list[str]:
        roots = [arg for root in self.host_path_roots for arg in ("--host-path-root", root)]
        return [sys.executable, "-m", "flotilla.cli", "operator", "run", "--kubeconfig", str(self.kubeconfig),
                "--metrics-port", str(self.metrics_port), *roots, *self.extra_args]  # fmt: skip

    def start(
        self,
        table: ProcessTable | None = None,
        timeout: float = 60,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        """With a table, the operator gets its own session and a pid record, so it outlives the caller
        and `flotilla cluster down` stops it. `env`: variables added to this process's (a chaos test's
        failpoint); `wait=False` returns without waiting for /healthz (an operator meant to die early)."""
        env = {**os.environ, **(env or {})}
        if table is not None:
            self.proc = table.start("operator", self.argv(), self.log_path, env=env, cwd=self.log_path.parent)
        else:
            with self.log_path.open("a") as log:
                self.proc = subprocess.Popen(
                    self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.log_path.parent
                )
        if not wait:
            return
        try:
            wait_for(
                lambda: self.get("/healthz")[0] == 200,
                timeout,
                f"the operator's /healthz (log: {self.log_path})",
            )
        except BaseException:
            self.stop()  # an operator that never became healthy is not left running
            if table is not None:
                table.forget("operator")
            raise

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def get(self, path: str) -> tuple[int, str]:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the operator exited with {self.proc.returncode}; see {self.log_path}")
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as rsp:
                return rsp.status, rsp.read().decode()
        except OSError as exc:
            return 0, str(exc)


def tiny_model(path: Path) -> Path:
    """A random-weight tiny-llama folder (`flotilla model init`), written once."""
    if not (path / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "flotilla.cli", "model", "init", "--preset", "tiny-llama", str(path)],
            check=True,
            capture_output=True,
            timeout=600,
        )
    return path


def inference_service(
    name: str, model: Path | str, namespace: str | None = None, served_name: str = "tiny", **spec
) -> dict:
    """An InferenceService on one H100 per replica; `spec` fields (camelCase) are added or replace."""
    uri = model if isinstance(model, str) else f"file://{model}"
    metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
    body = {
        "model": {"uri": uri, "servedName": served_name},
        "resources": {"gpus": 1, "gpuType": "h100"},
        "replicas": 1,
    }
    return {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": metadata,
        "spec": {**body, **spec},
    }


def complete(endpoint: str, prompt: str = "Hello", max_tokens: int = 4, model: str = "tiny") -> dict:
    """One completion from an OpenAI base URL (`status.endpoints`); fails unless it answers 200."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(
        f"{endpoint}/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as rsp:
        assert rsp.status == 200, rsp.status
        return json.loads(rsp.read())
