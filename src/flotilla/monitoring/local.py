"""`flotilla monitoring up`: a Prometheus for the local cluster, discovering what Flotilla runs through the
API server (kubernetes_sd), under a ServiceAccount that may only list and watch pods. It runs in the
cluster's pid table, so `flotilla cluster down` stops it too."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle, free_port, wait_for
from flotilla.cluster.paths import prometheus_path
from flotilla.cluster.processes import ProcessTable
from flotilla.monitoring.scrape import DISCOVERY_RULES, ApiAccess, prometheus_config

NAMESPACE = "flotilla-system"
ACCOUNT = "flotilla-prometheus"
PROCESS = "prometheus"


def discovery_rbac(namespace: str = NAMESPACE) -> list[dict]:
    """Prometheus's identity: a ServiceAccount bound to a ClusterRole that lists and watches pods."""
    meta = {"name": ACCOUNT, "labels": {"app.kubernetes.io/part-of": "flotilla"}}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {**meta, "namespace": namespace}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": meta,
            "rules": DISCOVERY_RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ACCOUNT},
            "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": namespace}],
        },
    ]


def up(
    cluster: ClusterHandle,
    state_dir: Path,
    *,
    port: int = 0,
    static_targets: dict[str, list[str]] | None = None,
    rule_files: list[str] | None = None,
    interval: str = "15s",
    log=print,
) -> str:
    """Starts (or restarts) the local Prometheus; returns its URL once it answers /-/ready. `interval` is
    both the scrape and the rule evaluation interval."""
    binary = prometheus_path()
    if not binary.exists():
        raise RuntimeError(f"{binary} is missing: run `flotilla cluster build`")
    workdir = state_dir / "prometheus"
    workdir.mkdir(parents=True, exist_ok=True)
    cluster.kubectl("apply", "-f", "-", input=manifest_yaml.dump_all(discovery_rbac()))
    token = cluster.kubectl("create", "token", ACCOUNT, "-n", NAMESPACE, "--duration=24h").stdout.strip()
    token_file = workdir / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    access = ApiAccess(cluster.config.server, str(cluster.config.pki_dir / "ca.crt"), str(token_file))
    config = prometheus_config(
        access, static_targets=static_targets, rule_files=rule_files, interval=interval
    )
    (workdir / "prometheus.yml").write_text(manifest_yaml.dump(config, sort_keys=False))
    table = ProcessTable(state_dir / "pids")
    table.stop(PROCESS)
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        str(binary),
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    log(f"   starting Prometheus on {url} (log {workdir / 'prometheus.log'})")
    table.start(PROCESS, argv, workdir / "prometheus.log", cwd=workdir)
    wait_for(lambda: _ready(url), 60, f"Prometheus at {url} to be ready (log {workdir / 'prometheus.log'})")
    return url


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as rsp:
            return rsp.status == 200
    except OSError:
        return False
