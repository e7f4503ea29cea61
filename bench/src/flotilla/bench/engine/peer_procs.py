"""The child processes of the comparisons with vLLM: a peer that answers JSON lines (offline_peer.py), and a
server waited for until /health answers 200. Each runs in a session of its own, pinned to the comparison's
cores, with its output in a log file, and is stopped by its own process group (vLLM's engine core and
worker are its children): SIGTERM, then SIGKILL. Long waits print progress."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from flotilla.contract import HEALTH_PATH

HOST = "127.0.0.1"
PROGRESS_EVERY_S = 15.0
# Never through a proxy from the environment: every URL here is a local process.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def progress(message: str) -> None:
    print(f"bench: [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class PeerError(RuntimeError):
    pass


class Child:
    """One child process in its own session, its output in `log`."""

    def __init__(self, name: str, argv: list[str], log: Path, env: Mapping[str, str], cpus: Iterable[int]):
        self.name, self.argv, self.log, self.env = name, argv, log, dict(env)
        self.cpus = set(cpus)
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self, stdin: Any = subprocess.DEVNULL, stdout: Any = None) -> Child:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            out.write(f"$ {' '.join(self.argv)}\n".encode())
            out.flush()
            cpus = self.cpus
            self.started = time.perf_counter()
            self.proc = subprocess.Popen(
                self.argv, stdin=stdin, stdout=stdout if stdout is not None else out,
                stderr=subprocess.STDOUT if stdout is None else out, env=self.env, start_new_session=True,
                preexec_fn=lambda: os.sched_setaffinity(0, cpus),
            )  # fmt: skip
        return self

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def cpu_seconds(self) -> float:
        """CPU time (user + system) its process group's live processes have used."""
        return group_cpu_seconds(self.proc.pid) if self.proc else 0.0

    def wait_quiet(self, window_s: float = 0.5, share: float = 0.02, timeout: float = 60.0) -> float:
        """Waits until the process group uses under `share` of a core over `window_s`, at most `timeout`
        seconds; returns the seconds waited. vLLM's worker keeps its OpenMP threads spinning for seconds
        after a batch (a fifth of a core here), which slows the other system's next run when it shares
        the cores."""
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            before = self.cpu_seconds()
            time.sleep(window_s)
            if self.cpu_seconds() - before < share * window_s:
                break
        return time.perf_counter() - start

    def failure(self, what: str) -> PeerError:
        return PeerError(f"{self.name} {what}; its log, {self.log}, ends:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the child's process group, SIGKILL to it after `timeout` seconds."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        # The group may outlive its leader (a worker still shutting down): kill it, and wait until it has
        # gone, so that its teardown does not overlap the next measurement.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.perf_counter() + timeout
        while group_stats(proc.pid) and time.perf_counter() < deadline:
            time.sleep(0.1)


class Peer(Child):
    """A child that answers JSON lines on its stdout and reads commands on its stdin (offline_peer.py)."""

    def start(self, stdin: Any = None, stdout: Any = None) -> Peer:
        super().start(stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return self

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc and self.proc.stdin
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, doing: str, timeout: float) -> dict[str, Any]:
        """The next answer; progress every PROGRESS_EVERY_S while waiting; a PeerError (with the log's
        end) when the peer fails, exits or takes longer than `timeout`."""
        assert self.proc and self.proc.stdout
        stdout: IO[bytes] = self.proc.stdout
        start = time.perf_counter()
        deadline = start + timeout
        next_note = start + PROGRESS_EVERY_S
        while True:
            ready, _, _ = select.select([stdout], [], [], 1.0)
            if ready:
                line = stdout.readline()
                if not line:
                    raise self.failure(f"exited (code {self.proc.wait(10)}) while {doing}")
                answer = json.loads(line)
                if answer.get("event") == "error":
                    raise self.failure(f"failed while {doing}: {answer.get('message')}")
                return answer
            now = time.perf_counter()
            if now > deadline:
                raise self.failure(f"took more than {timeout:.0f} s {doing}")
            if now >= next_note:
                progress(f"{self.name}: still {doing} ({now - start:.0f} s)")
                next_note += PROGRESS_EVERY_S

    def quit(self, timeout: float = 60.0) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send({"cmd": "quit"})
            assert self.proc
            self.proc.wait(timeout)
        self.stop()


class Server(Child):
    """A child that serves HTTP on the loopback at `port`."""

    def __init__(self, name: str, argv: list[str], log: Path, env: Mapping[str, str], cpus: Iterable[int],
                 port: int):  # fmt: skip
        super().__init__(name, argv, log, env, cpus)
        self.port = port
        self.url = f"http://{HOST}:{port}"

    def wait_healthy(self, timeout: float) -> float:
        """Seconds from the process's start to /health 200 (its start-up); a PeerError when it exits or
        misses `timeout`."""
        next_note = self.started + PROGRESS_EVERY_S
        while True:
            if health(self.url) == 200:
                return time.perf_counter() - self.started
            code = self.exited()
            if code is not None:
                raise self.failure(f"exited with code {code} before it was healthy")
            now = time.perf_counter()
            if now - self.started > timeout:
                raise self.failure(f"was not healthy within {timeout:.0f} s")
            if now >= next_note:
                progress(f"{self.name}: starting ({now - self.started:.0f} s)")
                next_note += PROGRESS_EVERY_S
            time.sleep(0.1)


def group_stats(pgid: int) -> list[list[str]]:
    """The /proc/PID/stat fields (after the command name, which may hold spaces) of the live processes in
    process group `pgid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # state, ppid, pgrp, ...
            found.append(fields)
    return found


def group_cpu_seconds(pgid: int) -> float:
    """The user + system CPU seconds of the live processes in process group `pgid` (all their threads)."""
    ticks = sum(int(f[11]) + int(f[12]) for f in group_stats(pgid))  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def busy_seconds(cpus: Iterable[int]) -> float:
    """CPU seconds the cores `cpus` have spent busy since boot (/proc/stat): user, nice, system,
    interrupts and time the hypervisor gave to others (steal); not idle or I/O wait, and guest time only
    once (user holds it)."""
    wanted = {f"cpu{n}" for n in cpus}
    total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *values = line.split()
            if name in wanted:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in values[:8])
                total += user + nice + system + irq + softirq + steal
    return total / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """How much of the measured cores' time other work took (everything but `children` and this process)
    while a measurement ran: on a shared machine a round that overlapped other work reads slow, and this
    says which. `share` is of the cores' time. It is approximate: kernel threads working for the measured
    processes (page compaction, say) count as other work, and so does hypervisor steal, while this
    process's own time counts as the measurement's wherever it ran."""

    def __init__(self, children: Iterable[Child], cpus: Iterable[int]) -> None:
        self.children, self.cpus = list(children), sorted(cpus)

    def _ours(self) -> float:
        own = os.times()  # with the children this process has reaped (a client that ran meanwhile)
        mine = own.user + own.system + own.children_user + own.children_system
        return sum(c.cpu_seconds() for c in self.children) + mine

    def __enter__(self) -> OtherLoad:
        self.start, self.busy, self.ours = time.perf_counter(), busy_seconds(self.cpus), self._ours()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.start
        others = max(0.0, (busy_seconds(self.cpus) - self.busy) - (self._ours() - self.ours))
        self.cpu_s = others
        self.share = min(1.0, others / (wall * len(self.cpus))) if wall > 0 and self.cpus else 0.0


def health(url: str) -> int | None:
    try:
        with _OPENER.open(url + HEALTH_PATH, timeout=2) as rsp:
            return rsp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None
