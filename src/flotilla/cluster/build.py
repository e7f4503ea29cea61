"""Builds etcd, the Kubernetes control plane, Prometheus and Helm with Go from the module proxy, cached per version."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from flotilla.cluster.gomod import GOMOD_DIR, go_env
from flotilla.cluster.paths import etcd_bin_dir, helm_bin_dir, kubernetes_bin_dir, prometheus_bin_dir
from flotilla.cluster.versions import ETCD_VERSION, HELM_VERSION, KUBERNETES_VERSION, prometheus_release

KUBE_BINARIES = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kubelet",
    "kube-proxy",
)
PROMETHEUS_BINARIES = ("prometheus", "promtool")
# Only the service discoveries Flotilla uses (kubernetes_sd; file and static are always in): a fraction
# of the build of all of them. The web UI's assets are not embedded; the API is all the tests need.
PROMETHEUS_TAGS = "remove_all_sd,enable_kubernetes_sd"


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class Target:
    name: str
    package: str
    module_dir: Path
    out_dir: Path
    ldflags: str
    tags: str = ""

    @property
    def path(self) -> Path:
        return self.out_dir / self.name


def _version_ldflags(version: str) -> str:
    major, minor, _ = version.lstrip("v").split(".")
    # The module proxy carries no git metadata: no commit, and a fixed build date keeps builds identical.
    values = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X '{package}.{key}={value}'" for key, value in values.items()]
    return " ".join(flags)


def targets() -> list[Target]:
    kube = [
        Target(
            name,
            f"k8s.io/kubernetes/cmd/{name}",
            GOMOD_DIR / "kubernetes",
            kubernetes_bin_dir(),
            _version_ldflags(KUBERNETES_VERSION),
        )
        for name in KUBE_BINARIES
    ]
    # The kubelet nodes' fake-GPU device plugin, a package of the Kubernetes wrapper module (its gRPC API).
    fakegpu = Target("fakegpu", "./fakegpu", GOMOD_DIR / "kubernetes", kubernetes_bin_dir(), "-s -w")
    etcd = Target("etcd", "go.etcd.io/etcd/server/v3", GOMOD_DIR / "etcd", etcd_bin_dir(), "-s -w")
    prometheus = [
        Target(
            name,
            f"github.com/prometheus/prometheus/cmd/{name}",
            GOMOD_DIR / "prometheus",
            prometheus_bin_dir(),
            _prometheus_ldflags(prometheus_release()),
            PROMETHEUS_TAGS,
        )
        for name in PROMETHEUS_BINARIES
    ]
    helm = Target(
        "helm", "helm.sh/helm/v4/cmd/helm", GOMOD_DIR / "helm", helm_bin_dir(), _helm_ldflags(HELM_VERSION)
    )
    return [etcd, *kube, fakegpu, *prometheus, helm]


def _helm_ldflags(version: str) -> str:
    # Helm reports this version and, in `helm template`/`lint`, uses it for .Capabilities.HelmVersion.
    values = {"version": version, "gitCommit": "", "gitTreeState": "clean"}
    return " ".join(
        ["-s", "-w", *(f"-X 'helm.sh/helm/v4/internal/version.{k}={v}'" for k, v in values.items())]
    )


def _prometheus_ldflags(release: str) -> str:
    values = {
        "Version": release,
        "Revision": "",
        "Branch": "",
        "BuildUser": "flotilla",
        "BuildDate": "19700101-00:00:00",
    }
    return " ".join(
        ["-s", "-w", *(f"-X 'github.com/prometheus/common/version.{k}={v}'" for k, v in values.items())]
    )


def missing_binaries() -> list[Target]:
    return [t for t in targets() if not t.path.exists()]


def _build_one(target: Target, step: str, log) -> None:
    if shutil.which("go") is None:
        raise BuildError(f"{step}: the `go` command is not on PATH; install Go 1.26 or newer")
    target.out_dir.mkdir(parents=True, exist_ok=True)
    # A per-process name, so two builds running at once never move each other's output.
    partial = target.out_dir / f".{target.name}.{os.getpid()}.partial"
    cmd = [
        "go",
        "build",
        "-v",
        "-trimpath",
        "-mod=readonly",
        *(["-tags", target.tags] if target.tags else []),
        "-ldflags",
        target.ldflags,
        "-o",
        str(partial),
        target.package,
    ]
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=target.module_dir, env=go_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    tail: list[str] = []
    assert proc.stdout is not None
    for compiled, line in enumerate(proc.stdout, 1):
        tail = (tail + [line.rstrip()])[-30:]
        if compiled % 100 == 0:
            log(f"  {step} {target.name}: {compiled} packages compiled ({time.monotonic() - started:.0f}s)")
    if proc.wait() != 0:
        detail = "\n".join(tail)
        raise BuildError(
            f"{step} failed: go build {target.package} (in {target.module_dir}) exited {proc.returncode}\n{detail}"
        )
    os.replace(partial, target.path)
    log(f"  {step} {target.name}: done in {time.monotonic() - started:.0f}s -> {target.path}")


def build(force: bool = False, log=None) -> dict:
    """Builds what is missing (or everything with force). Returns timing and peak-memory figures."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    todo = targets() if force else missing_binaries()
    if not todo:
        log(
            f"binaries cached: kubernetes {KUBERNETES_VERSION}, etcd {ETCD_VERSION}, "
            f"prometheus {prometheus_release()}, helm {HELM_VERSION}"
        )
        return {"built": [], "seconds": 0.0}
    started = time.monotonic()
    for index, target in enumerate(todo, 1):
        step = f"[{index}/{len(todo)}]"
        log(f"{step} building {target.name} from {target.package}")
        _build_one(target, step, log)
    seconds = time.monotonic() - started
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    log(f"built {len(todo)} binaries in {seconds:.0f}s, peak child memory {peak_mib:.0f} MiB")
    return {"built": [t.name for t in todo], "seconds": round(seconds, 1), "peak_rss_mib": round(peak_mib)}
