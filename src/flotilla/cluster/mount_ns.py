"""A container's own mount namespace: bind its volumes at their mountPaths, then exec its command.

The node agent starts a container as

    unshare --mount --propagation private -- PYTHON -I -m flotilla.cluster.mount_ns SPEC -- ARGV...

`unshare` without --fork execs in place, and so does this module, so the pid the agent records is the
container's own pid and signals to its process group reach it. SPEC is JSON: {"mounts": [{"source",
"target", "readOnly"}], "workingDir": path or null}. `--propagation private` keeps every mount made here
inside the new namespace: the host never sees them, and they vanish with the container's last process.

Mount targets are created on the host with `mkdir -p` (or an empty file for a file mount) before the bind,
because a bind mount needs an existing target. That leaves empty folders such as
/var/run/secrets/kubernetes.io/serviceaccount on the host; they stay empty there, which is acceptable on a
development machine (the alternative, an overlay over each parent, costs far more than it gives).

This module runs in every container process before its command, so it imports only the standard library.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys

MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384


def wrap_argv(python: str, mounts: list[dict], working_dir: str | None, argv: list[str]) -> list[str]:
    """The command line that runs argv in its own mount namespace with mounts in place.

    `-I` (isolated mode) keeps a container's PYTHONPATH/PYTHONHOME from breaking this wrapper's own
    start; the container's command still gets its environment untouched, since exec passes it on."""
    spec = json.dumps({"mounts": mounts, "workingDir": working_dir}, separators=(",", ":"))
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        python,
        "-I",
        "-m",
        "flotilla.cluster.mount_ns",
        spec,
        "--",
        *argv,
    ]


def available(python: str) -> tuple[bool, str]:
    """Whether containers can get mount namespaces here: root, `unshare` present, and a trial run of the
    wrapper (with one bind mount) succeeding. Returns (ok, why not)."""
    if os.geteuid() != 0:
        return False, "the node agent does not run as root"
    if shutil.which("unshare") is None:
        return False, "`unshare` (util-linux) is not installed"
    here = os.path.dirname(os.path.abspath(__file__))
    trial = wrap_argv(python, [{"source": here, "target": here, "readOnly": True}], None, ["true"])
    try:
        result = subprocess.run(trial, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"trial run failed: {exc}"
    if result.returncode != 0:
        return False, f"trial run failed ({result.returncode}): {result.stderr.strip()[-300:]}"
    return True, ""


def _libc_mount(source: str | None, target: str, flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's own libc; find_library would fork
    src = source.encode() if source is not None else None
    if libc.mount(src, target.encode(), None, ctypes.c_ulong(flags), None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} -> {target}: {os.strerror(errno)}")


def _make_target(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
        return
    os.makedirs(os.path.dirname(target) or "/", exist_ok=True)
    if not os.path.exists(target):
        with open(target, "a"):
            pass


def order(mounts: list[dict]) -> list[dict]:
    """Parents before children (shallower targets first), so a mount inside another volume lands on top."""
    return sorted(mounts, key=lambda m: os.path.normpath(m["target"]).count("/"))


def hides(target: str, protected: list[str]) -> str | None:
    """The protected path that a mount at `target` would cover, if any."""
    target = os.path.normpath(target)
    for path in protected:
        path = os.path.normpath(path)
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return path
    return None


def protected_paths(command: list[str]) -> list[str]:
    """What the container's command needs from the host: the interpreter's installation and import path
    (this wrapper runs on the same interpreter as the agent's pods: the venv and the checkout's src
    folders of an editable install) and the command's own folder. The root filesystem is the host's, so
    a volume over any of these (an emptyDir at /tmp with the checkout under /tmp) would hide the command."""
    paths = {sys.prefix, sys.base_prefix, *(p for p in sys.path if p and os.path.isdir(p))}
    found = shutil.which(command[0]) if command else None
    if found:
        paths.add(os.path.dirname(os.path.realpath(found)))
        paths.add(os.path.dirname(os.path.abspath(found)))
    return sorted(paths)


def apply(mounts: list[dict], protected: list[str] = ()) -> None:  # type: ignore[assignment]
    ordered = []
    for mount in order(mounts):
        covered = hides(mount["target"], list(protected))
        if covered:
            print(f"flotilla mount_ns: not mounting {mount['target']}: it would hide {covered}, which this "
                  "container runs from (the local cluster's pods share the host's root filesystem)",
                  file=sys.stderr, flush=True)  # fmt: skip
            continue
        ordered.append(mount)
    # Every source is opened before the first mount: a mount (an emptyDir at /tmp) may cover the folder
    # another mount's source lives in (the agent's state under /tmp); the open descriptor still reaches it.
    sources = []
    try:
        for mount in ordered:
            sources.append(os.open(mount["source"], os.O_PATH | os.O_CLOEXEC))
        for mount, fd in zip(ordered, sources, strict=True):
            _make_target(f"/proc/self/fd/{fd}", mount["target"])
            _libc_mount(f"/proc/self/fd/{fd}", mount["target"], MS_BIND | MS_REC)
    finally:
        for fd in sources:
            os.close(fd)
    # Read-only only after every bind: a read-only parent would refuse the mkdir of a child's target.
    for mount in ordered:
        if mount.get("readOnly"):
            _libc_mount(None, mount["target"], MS_REMOUNT | MS_BIND | MS_RDONLY)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m flotilla.cluster.mount_ns SPEC -- COMMAND...", file=sys.stderr)
        return 2
    spec, command = json.loads(argv[0]), argv[2:]
    try:
        apply(spec.get("mounts") or [], protected_paths(command))
        if spec.get("workingDir"):
            os.makedirs(spec["workingDir"], exist_ok=True)
            os.chdir(spec["workingDir"])
        os.execvp(command[0], command)
    except OSError as exc:
        # The container exits at once, with the shell's codes for a missing or unrunnable command; its log
        # says why.
        print(f"flotilla mount_ns: {exc}", file=sys.stderr, flush=True)
        return 127 if isinstance(exc, FileNotFoundError) else 126 if isinstance(exc, PermissionError) else 128
    return 0  # not reached: execvp replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
