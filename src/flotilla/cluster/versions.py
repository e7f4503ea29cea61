"""Pinned versions of the control-plane binaries. The Go wrapper modules are generated from these."""

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
# Prometheus publishes Go module versions v0.X.Y for its releases 3.X.Y (v0.316.0 is Prometheus 3.16.0).
PROMETHEUS_MODULE_VERSION = "v0.316.0"
# Helm 4, the CLI that installs the chart (charts/flotilla), built like the rest from the Go module proxy.
HELM_VERSION = "v4.3.2"


def prometheus_release(module_version: str = PROMETHEUS_MODULE_VERSION) -> str:
    """github.com/prometheus/prometheus v0.3XX.Y is Prometheus 3.XX.Y."""
    _, minor, patch = module_version.lstrip("v").split(".")
    return f"{int(minor) // 100}.{int(minor) % 100}.{patch}"


def staging_version(kubernetes_version: str = KUBERNETES_VERSION) -> str:
    """k8s.io/kubernetes v1.Y.Z publishes its staging modules as v0.Y.Z."""
    major, minor, patch = kubernetes_version.lstrip("v").split(".")
    if major != "1":
        raise ValueError(f"kubernetes version {kubernetes_version!r}: expected v1.Y.Z")
    return f"v0.{minor}.{patch}"
