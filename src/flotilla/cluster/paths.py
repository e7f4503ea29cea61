"""Where the local cluster keeps its binaries (per version, outside the repo) and its state."""

from __future__ import annotations

import os
from pathlib import Path

from flotilla.cluster.versions import ETCD_VERSION, HELM_VERSION, KUBERNETES_VERSION, prometheus_release


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flotilla"


def kubernetes_bin_dir() -> Path:
    return cache_root() / f"kubernetes-{KUBERNETES_VERSION}" / "bin"


def etcd_bin_dir() -> Path:
    return cache_root() / f"etcd-{ETCD_VERSION}" / "bin"


def prometheus_bin_dir() -> Path:
    return cache_root() / f"prometheus-v{prometheus_release()}" / "bin"


def prometheus_path() -> Path:
    return prometheus_bin_dir() / "prometheus"


def promtool_path() -> Path:
    return prometheus_bin_dir() / "promtool"


def helm_bin_dir() -> Path:
    return cache_root() / f"helm-{HELM_VERSION}" / "bin"


def helm_path() -> Path:
    return helm_bin_dir() / "helm"


def default_state_dir() -> Path:
    return Path(
        os.environ.get("FLOTILLA_CLUSTER_DIR") or Path.home() / ".local" / "state" / "flotilla" / "cluster"
    )
