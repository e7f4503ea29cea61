"""One pod's containers as local processes: start, watch, probe, restart with back-off, stop.

The node agent owns one PodRuntime per pod bound to its nodes and calls `sync` on every tick.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sysconfig
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from flotilla.cluster.pod_env import EnvError, base_env, container_argv, container_env
from flotilla.cluster.probes import ProbeTracker, run_probe
from flotilla.cluster.processes import ProcessTable, signal_group

# Where this interpreter's entry points (`flotilla`, `python`) live; pods find them first on PATH.
SCRIPTS_DIR = sysconfig.get_path("scripts")


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerRun:
    spec: dict
    restart_count: int = 0
    proc: subprocess.Popen | None = None
    started_at: str | None = None
    started_mono: float = 0.0
    last_terminated: dict | None = None  # the previous run's terminated state
    terminated: dict | None = None  # set when exited and not (yet) restarted
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    next_start: float = 0.0
    backoff: float = 0.0
    env: dict[str, str] | None = None  # the running process's environment (exec probes run in it)
    startup: ProbeTracker | None = None
    liveness: ProbeTracker | None = None
    readiness: ProbeTracker | None = None
    killed_by_probe: str = ""
    probes_ok: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def started(self) -> bool:
        return self.running and (self.startup is None or self.startup.result is True)

    @property
    def ready(self) -> bool:
        if not self.started:
            return False
        return self.readiness is None or self.readiness.result is True


class PodRuntime:
    def __init__(
        self,
        pod: dict,
        pod_ip: str,
        host_ip: str,
        log_dir: Path,
        pids: ProcessTable,
        lookups: tuple[Callable, Callable],
        probe_pool: ThreadPoolExecutor,
        backoff_base: float = 1.0,
        backoff_max: float = 30.0,
    ):
        self.pod = pod
        self.pod_ip = pod_ip
        self.host_ip = host_ip
        self.log_dir = log_dir
        self.pids = pids
        self.config_maps, self.secrets = lookups
        self.probe_pool = probe_pool
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        self.start_time = now_rfc3339()
        self.containers = [ContainerRun(spec) for spec in pod["spec"]["containers"]]
        self.terminating_deadline: float | None = None

    @property
    def key(self) -> str:
        meta = self.pod["metadata"]
        return f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"

    def _pid_name(self, run: ContainerRun) -> str:
        return f"{self.key}_{run.name}"

    @property
    def restart_policy(self) -> str:
        return self.pod["spec"].get("restartPolicy", "Always")

    # -- lifecycle -------------------------------------------------------------------------------

    def _start(self, run: ContainerRun, now: float) -> None:
        try:
            env = container_env(self.pod, run.spec, self.pod_ip, self.host_ip, self.config_maps, self.secrets)
            argv = container_argv(run.spec, env)
        except EnvError as exc:
            run.waiting_reason, run.waiting_message = "CreateContainerConfigError", str(exc)
            run.next_start = now + 2.0
            return
        process_env = base_env(os.environ, SCRIPTS_DIR)
        process_env.update(env)
        run.env = process_env
        workdir = Path(run.spec.get("workingDir") or self.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            run.proc = self.pids.start(
                self._pid_name(run), argv, self.log_dir / f"{run.name}.log", env=process_env, cwd=workdir
            )
        except OSError as exc:
            run.waiting_reason, run.waiting_message = "RunContainerError", f"cannot start {argv[0]!r}: {exc}"
            self._schedule_restart(run, now)
            return
        run.started_at, run.started_mono = now_rfc3339(), now
        run.terminated, run.waiting_reason, run.waiting_message, run.killed_by_probe = None, "", "", ""
        for kind in ("startup", "liveness", "readiness"):
            probe = run.spec.get(f"{kind}Probe")
            setattr(run, kind, ProbeTracker(probe, started_at=now) if probe else None)

    def _schedule_restart(self, run: ContainerRun, now: float) -> None:
        run.backoff = min(self.backoff_max, run.backoff * 2 if run.backoff else self.backoff_base)
        run.next_start = now + run.backoff

    def _on_exit(self, run: ContainerRun, now: float) -> None:
        code = run.proc.returncode
        self.pids.forget(self._pid_name(run))
        run.proc = None
        # A process killed by a signal reports -N; the kubelet reports 128+N.
        exit_code = 128 - code if code < 0 else code
        reason = "Completed" if exit_code == 0 else "Error"
        run.terminated = {
            "exitCode": exit_code,
            "reason": reason,
            "startedAt": run.started_at,
            "finishedAt": now_rfc3339(),
        }
        if run.killed_by_probe:
            run.terminated["message"] = run.killed_by_probe
        restart = self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and exit_code != 0)
        if restart and self.terminating_deadline is None:
            # A run that stayed up a while resets the back-off, as the kubelet does after 10 minutes.
            if now - run.started_mono > 60:
                run.backoff = 0.0
            self._schedule_restart(run, now)
            run.waiting_reason = "CrashLoopBackOff"
            run.waiting_message = f"back-off {run.backoff:.0f}s restarting failed container {run.name}"

    def _kill(self, run: ContainerRun, reason: str) -> None:
        if run.proc is not None and run.proc.poll() is None:
            run.killed_by_probe = reason
            signal_group(run.proc.pid, signal.SIGKILL)

    def _probe(self, run: ContainerRun, tracker: ProbeTracker | None, now: float) -> None:
        if tracker is None or not tracker.due(now):
            return
        tracker.running = True
        ports = run.spec.get("ports") or []
        future = self.probe_pool.submit(run_probe, tracker.probe, self.pod_ip, ports, run.env)
        future.add_done_callback(lambda f: tracker.record(bool(f.exception() is None and f.result())))

    def sync(self, now: float) -> None:
        if self.terminating_deadline is not None:
            return
        for run in self.containers:
            if run.proc is not None and run.proc.poll() is not None:
                self._on_exit(run, now)
            if run.proc is None:
                never_started = run.started_at is None and run.terminated is None
                may_restart = run.waiting_reason in (
                    "CrashLoopBackOff",
                    "CreateContainerConfigError",
                    "RunContainerError",
                    "ContainerCreating",
                )
                if (never_started or may_restart) and now >= run.next_start:
                    if run.terminated is not None:
                        run.last_terminated, run.terminated = run.terminated, None
                        run.restart_count += 1
                    self._start(run, now)
                continue
            if run.startup is not None and run.startup.result is not True:
                self._probe(run, run.startup, now)
                if run.startup.result is False:
                    self._kill(run, "startup probe failed")
                continue
            self._probe(run, run.liveness, now)
            if run.liveness is not None and run.liveness.result is False:
                self._kill(run, "liveness probe failed")
                continue
            self._probe(run, run.readiness, now)

    def begin_termination(self, grace_seconds: float, now: float) -> None:
        if self.terminating_deadline is not None:
            return
        self.terminating_deadline = now + grace_seconds
        for run in self.containers:
            if run.running:
                signal_group(run.proc.pid, signal.SIGTERM)

    def termination_done(self, now: float) -> bool:
        """True once every process is gone; SIGKILLs stragglers when the grace period is over."""
        alive = [run for run in self.containers if run.running]
        if alive and self.terminating_deadline is not None and now >= self.terminating_deadline:
            for run in alive:
                signal_group(run.proc.pid, signal.SIGKILL)
            time.sleep(0.05)
            alive = [run for run in self.containers if run.running]
        for run in self.containers:
            if run.proc is not None and run.proc.poll() is not None:
                self.pids.forget(self._pid_name(run))
        return not alive

    def kill_now(self) -> None:
        self.begin_termination(0, time.monotonic())
        while not self.termination_done(time.monotonic()):
            time.sleep(0.05)
