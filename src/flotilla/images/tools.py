"""The host's tools the images are made with: which Debian package brings each, and running them.

`flotilla images` installs nothing itself; a missing tool is an error that names the packages to install."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable

# runc, not buildah's default crun: crun refuses this project's hybrid-cgroup machines.
RUNC = "/usr/sbin/runc"

# tool (a name looked up on PATH, or an absolute path) -> the Debian package that installs it
TOOLS = {
    "buildah": "buildah",
    RUNC: "runc",
    "debootstrap": "debootstrap",
}

Out = Callable[[str], None]


class ImagesError(Exception):
    pass


def installed(tool: str) -> bool:
    return os.access(tool, os.X_OK) if tool.startswith("/") else shutil.which(tool) is not None


def missing_packages(found: Callable[[str], bool] = installed) -> list[str]:
    """The Debian packages whose tools are not on this machine, in TOOLS' order."""
    return [package for tool, package in TOOLS.items() if not found(tool)]


def missing_tools_message(packages: list[str]) -> str:
    return (
        f"missing tools; install the Debian packages {', '.join(packages)}: "
        f"apt-get install -y {' '.join(packages)}"
    )


def check_host(found: Callable[[str], bool] = installed, euid: int | None = None) -> None:
    """Raise ImagesError unless the tools are installed and we are root (debootstrap, chroot and buildah's
    storage in /var/lib/containers need it)."""
    packages = missing_packages(found)
    if packages:
        raise ImagesError(missing_tools_message(packages))
    if (os.geteuid() if euid is None else euid) != 0:
        raise ImagesError("must run as root (debootstrap, chroot and buildah's system storage need it)")


def capture(argv: list[str]) -> str:
    """A command's standard output; ImagesError with its standard error when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ImagesError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def stream(
    argv: list[str],
    prefix: str,
    out: Out,
    on_line: Callable[[str], None] | None = None,
) -> float:
    """Run a command, printing each line it writes (stdout and stderr) after `prefix`; the seconds it took.
    `on_line` sees each line first (the build's step clock)."""
    started = time.monotonic()
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if on_line is not None:
                on_line(line)
            out(f"{prefix} {line}")
    if proc.returncode != 0:
        raise ImagesError(f"{' '.join(argv)} failed with exit status {proc.returncode}")
    return time.monotonic() - started
