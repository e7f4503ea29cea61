"""Pinned versions of the control-plane binaries. The Go wrapper modules are generated from these."""

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"


def staging_version(kubernetes_version: str = KUBERNETES_VERSION) -> str:
    """k8s.io/kubernetes v1.Y.Z publishes its staging modules as v0.Y.Z."""
    major, minor, patch = kubernetes_version.lstrip("v").split(".")
    if major != "1":
        raise ValueError(f"kubernetes version {kubernetes_version!r}: expected v1.Y.Z")
    return f"v0.{minor}.{patch}"
