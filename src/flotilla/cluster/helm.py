"""`helm`, the binary `flotilla cluster build` makes from helm.sh/helm/v4, run against a kubeconfig."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from flotilla.cluster.paths import helm_path


class HelmError(RuntimeError):
    pass


def helm(
    *args: str, kubeconfig: Path | None = None, check: bool = True, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Runs helm; fails with its stderr when it exits non-zero (and `check`)."""
    binary = helm_path()
    if not binary.exists():
        raise HelmError(
            f"{binary} is missing: run `flotilla cluster build` (it builds Helm with the control plane)"
        )
    env = dict(os.environ)
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    result = subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and result.returncode != 0:
        raise HelmError(f"helm {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
    return result
