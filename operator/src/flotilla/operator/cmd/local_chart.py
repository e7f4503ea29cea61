"""Flotilla installed on the local cluster through its Helm chart, as a platform team installs it.

The local cluster's API server cannot reach a Service (no kube-proxy, no cluster network), so the
webhook's Service (and the gateway's, for clients on the host) is a NodePort, which the node agent forwards to the operator's Ready pods, and the
webhook configuration dials `https://127.0.0.1:<nodePort>`. The operator shares the host's disks with
the node agent's pods, so it checks file:// model paths. Everything else is the chart's defaults.
"""

from __future__ import annotations

import socket
import tempfile
import time
from pathlib import Path

from flotilla import manifest_yaml
from flotilla.cluster.handle import ClusterHandle
from flotilla.cluster.helm import helm

CHART_DIR = Path("charts") / "flotilla"  # relative to the repository root, like crds/ and deploy/
RELEASE = "flotilla"
NAMESPACE = "flotilla-system"
# The API server's default --service-node-port-range.
NODE_PORTS = range(30000, 32768)


def operator_pods(cluster: ClusterHandle) -> list[dict]:
    """The release's operator pods that are not being deleted."""
    items = cluster.get_json("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=flotilla-operator")[
        "items"
    ]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def free_node_port() -> int:
    """A port in the node-port range that nothing on 127.0.0.1 listens on now (tried from a random start,
    so two clusters on one host rarely pick the same)."""
    import random

    start = random.randrange(len(NODE_PORTS))
    for offset in range(len(NODE_PORTS)):
        port = NODE_PORTS[(start + offset) % len(NODE_PORTS)]
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in the node-port range 30000-32767")


def local_values(
    webhook_node_port: int,
    model_dirs: tuple[Path, ...] = (),
    gateway_node_port: int | None = None,
    host_path_roots: tuple[Path, ...] = (),
    **overrides: object,
) -> dict:
    """`model_dirs`: folders the operator must see to check file:// models. It shares the host's disks,
    except /tmp, where its pod mounts an emptyDir; each is mounted from the host at its own path. They
    are host-path roots too (operator.hostPathRoots), with `host_path_roots` (folders tenants name that the
    operator need not mount, e.g. an adapterDir): none else may be mounted into engines. With
    `gateway_node_port`, the gateway's Service is a NodePort there (http://127.0.0.1:<port>/v1)."""
    mounts = [
        ({"name": f"model-{i}", "hostPath": {"path": str(d), "type": "Directory"}},
         {"name": f"model-{i}", "mountPath": str(d), "readOnly": True})
        for i, d in enumerate(model_dirs)
    ]  # fmt: skip
    values: dict = {
        "operator": {
            "checkModelPaths": True,
            "hostPathRoots": list(dict.fromkeys(str(d) for d in (*model_dirs, *host_path_roots))),
            "extraVolumes": [volume for volume, _ in mounts],
            "extraVolumeMounts": [mount for _, mount in mounts],
        },
        "webhook": {
            "service": {"type": "NodePort", "nodePort": webhook_node_port},
            "url": f"https://127.0.0.1:{webhook_node_port}",
        },
    }
    if gateway_node_port is not None:
        values["gateway"] = {"service": {"type": "NodePort", "nodePort": gateway_node_port}}
    for dotted, value in overrides.items():  # operator__replicas=2 -> operator.replicas
        *path, leaf = dotted.split("__")
        node = values
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = value
    return values


def install(
    cluster: ClusterHandle,
    values: dict,
    *,
    chart: Path = CHART_DIR,
    timeout: str = "5m",
    log=print,
) -> float:
    """`helm upgrade --install --wait`: returns the seconds until Helm saw every object ready."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="flotilla-values-") as file:
        file.write(manifest_yaml.dump(values))
        file.flush()
        adopt(cluster, chart, file.name)
        log(f"helm upgrade --install {RELEASE} {chart} -n {NAMESPACE} (waiting up to {timeout} for Ready)")
        started = time.monotonic()
        helm(
            "upgrade", "--install", RELEASE, str(chart), "--namespace", NAMESPACE, "--create-namespace",
            "--values", file.name, "--wait", "--timeout", timeout,
            kubeconfig=cluster.kubeconfig, timeout=900,
        )  # fmt: skip
    return time.monotonic() - started


def adopt(cluster: ClusterHandle, chart: Path, values_file: str) -> None:
    """Marks the objects the chart renders that already exist as this release's, Helm's own way
    (`app.kubernetes.io/managed-by: Helm` and the release annotations), so that a cluster where the
    operator ran as a host process (its CRDs and RBAC applied by `flotilla operator` tooling, as earlier
    demos and the other e2e tests do) moves to the chart instead of failing with "cannot be imported
    into the current release". Objects that do not exist are skipped; Helm creates them."""
    rendered = helm(
        "template", RELEASE, str(chart), "--namespace", NAMESPACE, "--values", values_file,
        "--no-hooks", kubeconfig=cluster.kubeconfig,
    ).stdout  # fmt: skip
    cluster.kubectl(
        "label", "--overwrite", "-f", "-", "app.kubernetes.io/managed-by=Helm", input=rendered, check=False
    )
    cluster.kubectl(
        "annotate", "--overwrite", "-f", "-",
        f"meta.helm.sh/release-name={RELEASE}", f"meta.helm.sh/release-namespace={NAMESPACE}",
        input=rendered, check=False,
    )  # fmt: skip


def uninstall(cluster: ClusterHandle, timeout: str = "5m") -> None:
    helm(
        "uninstall",
        RELEASE,
        "--namespace",
        NAMESPACE,
        "--wait",
        "--timeout",
        timeout,
        kubeconfig=cluster.kubeconfig,
    )
