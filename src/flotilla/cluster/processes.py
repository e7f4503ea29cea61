"""Starting and stopping the cluster's own processes, by pid, never by name.

Each started process is recorded with its pid and its start time from /proc, so a later `down` stops
exactly that process and never a stranger that reused the pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def _start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 (starttime) counted after the ")" that closes the command name, which may hold spaces.
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True)
class Recorded:
    name: str
    pid: int
    start_ticks: int

    def alive(self) -> bool:
        return _start_ticks(self.pid) == self.start_ticks and not _is_zombie(self.pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class Adopted:
    """A process that a previous node agent started and this one took over (as a kubelet restarted finds
    its containers still running under the container runtime). Whether it lives is read from /proc; its
    exit status is lost, since only a parent can read it, so `returncode` reads as a SIGKILL once it has
    gone and `status_known` says so."""

    status_known = False

    def __init__(self, record: Recorded):
        self.record = record
        self.pid = record.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self.record.alive():
            self.returncode = -signal.SIGKILL
        return self.returncode


class ProcessTable:
    """pid records in a folder: one JSON file per process name."""

    def __init__(self, folder: Path):
        self.folder = folder

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def get(self, name: str) -> Recorded | None:
        try:
            data = json.loads(self._path(name).read_text())
        except (OSError, ValueError):
            return None
        return Recorded(name, int(data["pid"]), int(data["start_ticks"]))

    def running(self, name: str) -> Recorded | None:
        record = self.get(name)
        return record if record and record.alive() else None

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.folder.glob("*.json")) if self.folder.exists() else []

    def start(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen:
        """Starts argv in its own session (so its whole process group can be signalled) and records it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        ticks = _start_ticks(proc.pid)
        self._path(name).write_text(
            json.dumps({"pid": proc.pid, "start_ticks": ticks if ticks is not None else -1, "argv": argv})
        )
        return proc

    def forget(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def stop(self, name: str, grace_seconds: float = 10.0) -> bool:
        """SIGTERM, then SIGKILL after the grace period. Returns whether a live process was stopped."""
        record = self.get(name)
        self._path(name).unlink(missing_ok=True)
        if record is None or not record.alive():
            return False
        stop_pid(record, grace_seconds)
        return True


def signal_group(pid: int, sig: int) -> None:
    """Signals the process group that `pid` leads (every process we start leads its own session)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_pid(record: Recorded, grace_seconds: float) -> None:
    signal_group(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        if not record.alive():
            return
        _reap(record.pid)
        time.sleep(0.1)
    if record.alive():
        signal_group(record.pid, signal.SIGKILL)
    for _ in range(50):
        _reap(record.pid)
        if not record.alive():
            return
        time.sleep(0.1)


def _reap(pid: int) -> None:
    """Collects our own child so it does not linger as a zombie; a stranger's pid raises and is ignored."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def stop_all(folder: Path, grace_seconds: float = 5.0) -> list[str]:
    """Stops every live process recorded in folder, e.g. pod processes an agent left behind."""
    table = ProcessTable(folder)
    return [name for name in table.names() if table.stop(name, grace_seconds)]
