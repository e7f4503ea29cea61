"""One pod's containers as local processes: start, watch, probe, restart with back-off, stop.

The node agent owns one PodRuntime per pod bound to its nodes and calls `sync` on every tick. A tick
first stages the pod's volumes (nothing starts until they are all there), then runs the init containers
one at a time, each to exit 0 before the next, and only then starts the main containers. Init containers
with `restartPolicy: Always` are sidecars: the next one starts once the sidecar has started, and it keeps
running (and restarting) beside the main containers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sysconfig
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from flotilla import timestamps
from flotilla.cluster.mount_ns import wrap_argv
from flotilla.cluster.pod_env import EnvError, base_env, container_argv, container_env
from flotilla.cluster.pod_volumes import PodVolumes
from flotilla.cluster.probes import ProbeTracker, run_probe
from flotilla.cluster.processes import Adopted, ProcessTable, signal_group
from flotilla.cluster.volume_contents import VolumeError

# Where this interpreter's entry points (`flotilla`, `python`) live; pods find them first on PATH.
SCRIPTS_DIR = sysconfig.get_path("scripts")


PROBES = ("startup", "liveness", "readiness")


def pod_key(pod: dict) -> str:
    """The prefix of a pod's process names in the pid table: `{namespace}_{name}_{uid[:8]}`."""
    meta = pod["metadata"]
    return f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"


def process_name(pod: dict, container: str) -> str:
    """A container's name in the pid table: `{namespace}_{name}_{uid[:8]}_{container}`."""
    return f"{pod_key(pod)}_{container}"


def process_names(pod: dict) -> list[str]:
    """The pid-table names of every container the pod declares (init containers first)."""
    spec = pod["spec"]
    return [process_name(pod, c["name"]) for c in [*(spec.get("initContainers") or []), *spec["containers"]]]


@dataclass
class ContainerRun:
    spec: dict
    init: bool = False  # an init container (sidecars too)
    restart_count: int = 0
    proc: subprocess.Popen | Adopted | None = None
    adopted: bool = False  # the running process was started by a previous agent (its exit status is lost)
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
    done: bool = False  # an init container that exited 0

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def sidecar(self) -> bool:
        return self.init and self.spec.get("restartPolicy") == "Always"

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
        volumes: PodVolumes | None = None,
        sandbox_python: str | None = None,
        services: dict[str, str] | None = None,
    ):
        """volumes: the pod's staged volumes (None: volumes are ignored); sandbox_python: the interpreter
        that runs mount_ns in each container's own mount namespace (None: containers run without their
        mounts); services: the KUBERNETES_SERVICE_* variables every container gets."""
        self.pod = pod
        self.pod_ip = pod_ip
        self.host_ip = host_ip
        self.log_dir = log_dir
        self.pids = pids
        self.config_maps, self.secrets = lookups
        self.probe_pool = probe_pool
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        self.start_time = timestamps.now()
        self.volumes = volumes
        self.sandbox_python = sandbox_python
        self.services = services or {}
        self.init_containers = [
            ContainerRun(spec, init=True) for spec in pod["spec"].get("initContainers") or []
        ]
        self.containers = [ContainerRun(spec) for spec in pod["spec"]["containers"]]
        if self.init_containers:
            for run in self.containers:
                run.waiting_reason = "PodInitializing"
        self.initialized = not self.init_containers
        self.volume_problem = ""  # why the volumes are not staged yet: every container waits
        self.refresh_problems: list[str] = []  # for the agent to log and clear
        self.next_volume_try = 0.0
        self.terminating_deadline: float | None = None

    @property
    def all_runs(self) -> list[ContainerRun]:
        return [*self.init_containers, *self.containers]

    @property
    def init_failed(self) -> bool:
        """An init container failed under restartPolicy Never: the pod is Failed and nothing more runs."""
        return self.restart_policy == "Never" and any(
            r.terminated is not None and r.terminated["exitCode"] != 0 and not r.sidecar
            for r in self.init_containers
        )

    @property
    def key(self) -> str:
        return pod_key(self.pod)

    def _pid_name(self, run: ContainerRun) -> str:
        return process_name(self.pod, run.name)

    @property
    def restart_policy(self) -> str:
        return self.pod["spec"].get("restartPolicy", "Always")

    # -- lifecycle -------------------------------------------------------------------------------

    def adopt(self, now: float) -> list[str]:
        """Takes over the processes a previous node agent started for this pod, as a restarted kubelet
        finds its containers still running: the pid table is this node's container runtime. Each adopted
        container keeps its pid, start time, restart count and last verdicts of its startup and readiness
        probes from the pod's reported status, so the pod neither restarts nor flaps its readiness; a
        process that ended while no agent watched it is seen as ended on the next tick (exit status
        unknown) and restarted as its restartPolicy says. Returns the containers taken over."""
        status = self.pod.get("status") or {}
        reported = {
            s["name"]: s
            for s in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
        }
        adopted = []
        for run in self.all_runs:
            record = self.pids.get(self._pid_name(run))
            if record is None:
                continue
            seen = reported.get(run.name) or {}
            run.proc, run.adopted = Adopted(record), True
            run.restart_count = int(seen.get("restartCount") or 0)
            run.started_at = ((seen.get("state") or {}).get("running") or {}).get(
                "startedAt"
            ) or timestamps.now()
            run.started_mono = now
            run.last_terminated = (seen.get("lastState") or {}).get("terminated")
            run.waiting_reason, run.waiting_message = "", ""
            for kind in PROBES:
                probe = run.spec.get(f"{kind}Probe")
                if not probe:
                    continue
                # Its initial delay passed under the previous agent: probe on the usual period from now.
                tracker = ProbeTracker(probe, started_at=now - float(probe.get("initialDelaySeconds", 0)))
                if (kind == "startup" and seen.get("started")) or (kind == "readiness" and seen.get("ready")):
                    tracker.result = True
                setattr(run, kind, tracker)
            adopted.append(run.name)
        if adopted:
            self.start_time = status.get("startTime") or self.start_time
        if any(run.adopted for run in self.containers):
            # Main containers run only after every init container did its part.
            self.initialized = True
            for run in self.init_containers:
                run.done = run.done or not run.sidecar
            for run in self.containers:
                if run.waiting_reason == "PodInitializing":
                    run.waiting_reason = "ContainerCreating"
        return adopted

    def _start(self, run: ContainerRun, now: float) -> None:
        try:
            env = container_env(
                self.pod, run.spec, self.pod_ip, self.host_ip, self.config_maps, self.secrets, self.services
            )
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
        if self.sandbox_python and self.volumes is not None:
            try:
                mounts = self.volumes.mounts_for(run.name)
            except (VolumeError, OSError) as exc:
                run.waiting_reason, run.waiting_message = "CreateContainerConfigError", str(exc)
                run.next_start = now + 2.0
                return
            # The wrapper changes into workingDir after mounting, since it may lie inside a volume.
            argv = wrap_argv(self.sandbox_python, mounts, run.spec.get("workingDir"), argv)
            workdir = self.log_dir
        try:
            run.proc = self.pids.start(
                self._pid_name(run), argv, self.log_dir / f"{run.name}.log", env=process_env, cwd=workdir
            )
        except OSError as exc:
            run.waiting_reason, run.waiting_message = "RunContainerError", f"cannot start {argv[0]!r}: {exc}"
            self._schedule_restart(run, now)
            return
        run.started_at, run.started_mono = timestamps.now(), now
        run.terminated, run.waiting_reason, run.waiting_message, run.killed_by_probe = None, "", "", ""
        run.adopted = False
        for kind in PROBES:
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
            "finishedAt": timestamps.now(),
        }
        if run.killed_by_probe:
            run.terminated["message"] = run.killed_by_probe
        if run.adopted:
            # The kubelet's word for a container whose end it saw but whose exit status it cannot read.
            run.terminated["reason"] = "ContainerStatusUnknown"
            run.terminated["message"] = (
                "the process was started by a previous node agent, so its exit status could not be read"
            )
            run.adopted = False
        if run.sidecar:
            restart = True
        elif run.init:
            # An init container must succeed: it reruns on failure unless the pod never restarts.
            run.done = exit_code == 0
            restart = exit_code != 0 and self.restart_policy != "Never"
        else:
            restart = self.restart_policy == "Always" or (
                self.restart_policy == "OnFailure" and exit_code != 0
            )
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
        probe = tracker.probe
        if "exec" in probe and self.sandbox_python and run.proc is not None:
            # As in a container: the command sees the container's mounts, not the host's.
            command = ["nsenter", f"--target={run.proc.pid}", "--mount", "--", *probe["exec"]["command"]]
            probe = {**probe, "exec": {"command": command}}
        future = self.probe_pool.submit(run_probe, probe, self.pod_ip, ports, run.env)
        future.add_done_callback(lambda f: tracker.record(bool(f.exception() is None and f.result())))

    def _volumes_ready(self, now: float) -> bool:
        if self.volumes is None:
            return True
        if self.volumes.prepared:
            # Labels and annotations may change; downwardAPI files follow them on the next refresh.
            self.volumes.observe(self.pod)
            # A failed refresh keeps the old files in place; the agent logs what went wrong.
            self.refresh_problems.extend(self.volumes.refresh(now))
            return True
        if now < self.next_volume_try:
            return False
        try:
            self.volumes.prepare(now)
        except Exception as exc:  # VolumeError, OSError, or the API failing: retried, never the whole tick
            # The kubelet's FailedMount: every container waits in ContainerCreating and it is retried.
            self.volume_problem = f"MountVolume failed: {exc}"
            self.next_volume_try = now + 2.0
            for run in self.all_runs:
                if run.proc is None and run.started_at is None:
                    run.waiting_reason, run.waiting_message = "ContainerCreating", self.volume_problem
            return False
        self.volume_problem = ""
        for run in self.all_runs:
            if run.waiting_message.startswith("MountVolume failed"):
                run.waiting_message = ""
                run.waiting_reason = (
                    "PodInitializing" if self.init_containers and not run.init else "ContainerCreating"
                )
        return True

    def _sync_init(self, now: float) -> None:
        """Runs the init containers in order; sets `initialized` once every one has done its part."""
        for run in self.init_containers:
            if run.sidecar:
                self._sync_container(run, now)
                if run.started:
                    continue
                return
            if run.done:
                continue
            if run.proc is not None and run.proc.poll() is not None:
                self._on_exit(run, now)
                if run.done:
                    continue  # the next one starts on this same tick
            if run.proc is None and not self.init_failed:
                self._start_when_due(run, now)
            return
        self.initialized = True
        for run in self.containers:
            if run.waiting_reason == "PodInitializing":
                run.waiting_reason = "ContainerCreating"

    def _start_when_due(self, run: ContainerRun, now: float) -> None:
        never_started = run.started_at is None and run.terminated is None
        may_restart = run.waiting_reason in (
            "CrashLoopBackOff",
            "CreateContainerConfigError",
            "RunContainerError",
            "ContainerCreating",
            "PodInitializing",
        )
        if (never_started or may_restart) and now >= run.next_start:
            if run.terminated is not None:
                run.last_terminated, run.terminated = run.terminated, None
                run.restart_count += 1
            self._start(run, now)

    def _sync_container(self, run: ContainerRun, now: float) -> None:
        if run.proc is not None and run.proc.poll() is not None:
            self._on_exit(run, now)
        if run.proc is None:
            self._start_when_due(run, now)
            return
        if run.startup is not None and run.startup.result is not True:
            self._probe(run, run.startup, now)
            if run.startup.result is False:
                self._kill(run, "startup probe failed")
            return
        self._probe(run, run.liveness, now)
        if run.liveness is not None and run.liveness.result is False:
            self._kill(run, "liveness probe failed")
            return
        self._probe(run, run.readiness, now)

    def sync(self, now: float) -> None:
        if self.terminating_deadline is not None or not self._volumes_ready(now):
            return
        if not self.initialized:
            self._sync_init(now)
            if not self.initialized:
                return
        else:
            for run in self.init_containers:
                if run.sidecar:
                    self._sync_container(run, now)
        for run in self.containers:
            self._sync_container(run, now)

    def begin_termination(self, grace_seconds: float, now: float) -> None:
        if self.terminating_deadline is not None:
            return
        self.terminating_deadline = now + grace_seconds
        for run in self.all_runs:
            if run.running:
                signal_group(run.proc.pid, signal.SIGTERM)

    def termination_done(self, now: float) -> bool:
        """True once every process is gone; SIGKILLs stragglers when the grace period is over."""
        alive = [run for run in self.all_runs if run.running]
        if alive and self.terminating_deadline is not None and now >= self.terminating_deadline:
            for run in alive:
                signal_group(run.proc.pid, signal.SIGKILL)
            time.sleep(0.05)
            alive = [run for run in self.all_runs if run.running]
        for run in self.all_runs:
            if run.proc is not None and run.proc.poll() is not None:
                self.pids.forget(self._pid_name(run))
        return not alive

    def record_exits(self, now: float) -> None:
        """Reports each stopped process as terminated (its finishedAt), as the kubelet writes a deleted pod's
        stopped containers before it lets the pod go: whoever meters the pod reads its end there."""
        for run in self.all_runs:
            if run.proc is not None and run.proc.poll() is not None:
                self._on_exit(run, now)

    def kill_now(self) -> None:
        self.begin_termination(0, time.monotonic())
        while not self.termination_done(time.monotonic()):
            time.sleep(0.05)
