"""One kubelet node as a machine of its own: `python -m flotilla.cluster.node_machine SPEC.json`, started by
node_host under `unshare --mount --net --uts` (so this process is already inside the node's namespaces).

It mounts the node's folders at the standard paths, brings up the network interface node_host moved in,
makes the node's cgroup roots, then runs containerd, the kubelet, kube-proxy and the fake-GPU device
plugin, restarting any that exits (as systemd would). On SIGTERM it stops them and every container of the
node, so nothing outlives the node."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")
RESTART_BACKOFF = (1.0, 30.0)


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} node: {msg}", flush=True)


def run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


def cgroup_hierarchies() -> list[Path]:
    """The mounted cgroup v1 hierarchies and the v2 one, where the node's cgroup root must exist."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, target, fstype, *_ = line.split()
        if fstype in ("cgroup", "cgroup2"):
            found.append(Path(target))
    return found


def make_cgroup_root(root: str) -> None:
    for hierarchy in cgroup_hierarchies():
        path = hierarchy / root.lstrip("/")
        path.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):  # a new cpuset takes no task until these are set
            if (path / name).exists() and not (path / name).read_text().strip():
                (path / name).write_text((hierarchy / name).read_text())


def cgroup_pids(root: str) -> set[int]:
    pids: set[int] = set()
    for hierarchy in cgroup_hierarchies():
        base = hierarchy / root.lstrip("/")
        if base.exists():
            for procs in base.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    pids |= {int(p) for p in procs.read_text().split()}
    return pids


def remove_cgroup_root(root: str) -> None:
    for hierarchy in cgroup_hierarchies():
        base = hierarchy / root.lstrip("/")
        if base.exists():
            for folder in sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            with contextlib.suppress(OSError):
                base.rmdir()


def same_mount_namespace() -> set[int]:
    """Every process in this mount namespace but this one: the node's daemons and containerd's shims."""
    own = os.readlink("/proc/self/ns/mnt")
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if os.readlink(entry / "ns" / "mnt") == own:
                    pids.add(int(entry.name))
            except OSError:
                pass
    return pids


def kill_all(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Daemon:
    name: str
    argv: list[str]
    log_path: Path
    pids_file: Path  # every daemon's current pid, for the host (node_host.daemon_pid)
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    backoff: float = RESTART_BACKOFF[0]

    def start(self) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        log(f"{self.name} started (pid {self.proc.pid})")
        pids = json.loads(self.pids_file.read_text()) if self.pids_file.exists() else {}
        pids[self.name] = self.proc.pid
        partial = self.pids_file.with_suffix(".partial")
        partial.write_text(json.dumps(pids))
        partial.replace(self.pids_file)  # the host never reads half a file

    def tend(self, now: float) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        if self.proc is not None:
            log(f"{self.name} exited {self.proc.returncode}; restarting in {self.backoff:.0f}s")
            self.proc, self.next_start = None, now + self.backoff
            self.backoff = min(self.backoff * 2, RESTART_BACKOFF[1])
            self.restarts += 1
        if now >= self.next_start:
            self.start()

    def stop(self, grace: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Spec:
    name: str
    ip: str
    gateway: str
    cgroup_root: str
    mounts: dict[str, str]  # target -> source folder
    logs_dir: Path
    containerd: list[str]
    images: list[str]  # archives imported into containerd's k8s.io namespace before the kubelet starts
    ctr: list[str]
    daemons: dict[str, list[str]] = field(default_factory=dict)  # name -> argv, started in this order

    @classmethod
    def load(cls, path: Path) -> Spec:
        data = json.loads(path.read_text())
        data["logs_dir"] = Path(data["logs_dir"])
        return cls(**data)


def mount_folders(mounts: dict[str, str]) -> None:
    run("mount", "--make-rslave", "/")  # the host's mounts reach the node; the node's stay inside it
    for target, source in mounts.items():
        Path(source).mkdir(parents=True, exist_ok=True)
        Path(target).mkdir(parents=True, exist_ok=True)
        run("mount", "--bind", source, target)
    # The kubelet mounts volumes under its root folder; containers must see them (mount propagation).
    run("mount", "--make-rshared", "/var/lib/kubelet")


def bring_up_network(spec: Spec, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not Path("/sys/class/net/eth0").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the node's eth0 never arrived (node_host moves it in after the start)")
        time.sleep(0.1)
    run("ip", "link", "set", "lo", "up")
    run("ip", "addr", "add", f"{spec.ip}/24", "dev", "eth0")
    run("ip", "link", "set", "eth0", "up")
    run("ip", "route", "add", "default", "via", spec.gateway)
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")  # this network namespace's own
    bridged = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if bridged.exists():
        bridged.write_text("1")  # Services between pods on one bridge go through kube-proxy's rules
    run("hostname", spec.name)


def wait_for_socket(path: Path, proc: Daemon, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.proc is not None and proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited {proc.proc.returncode}; see {proc.log_path}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} did not open {path} in {timeout:.0f}s; see {proc.log_path}")
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    spec = Spec.load(Path(argv[0]))
    spec.logs_dir.mkdir(parents=True, exist_ok=True)
    stopping = False

    def on_term(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    mount_folders(spec.mounts)
    bring_up_network(spec)
    make_cgroup_root(spec.cgroup_root)
    pids_file = spec.logs_dir.parent / "daemons.json"
    pids_file.unlink(missing_ok=True)
    containerd = Daemon("containerd", spec.containerd, spec.logs_dir / "containerd.log", pids_file)
    containerd.start()
    wait_for_socket(Path("/run/containerd/containerd.sock"), containerd)
    for archive in spec.images:
        started = time.monotonic()
        run(*spec.ctr, "images", "import", archive)
        log(f"imported {archive} in {time.monotonic() - started:.1f}s")
    daemons = [containerd] + [
        Daemon(n, a, spec.logs_dir / f"{n}.log", pids_file) for n, a in spec.daemons.items()
    ]
    for daemon in daemons[1:]:
        daemon.start()
    log("node up")
    while not stopping:
        now = time.monotonic()
        for daemon in daemons:
            daemon.tend(now)
        time.sleep(0.5)
    log("stopping: the kubelet, kube-proxy and the device plugin, then every container, then containerd")
    for daemon in reversed(daemons[1:]):
        daemon.stop(10.0)
    kill_all(cgroup_pids(spec.cgroup_root))
    containerd.stop(10.0)
    kill_all(same_mount_namespace())  # the shims
    deadline = time.monotonic() + 10
    while cgroup_pids(spec.cgroup_root) and time.monotonic() < deadline:
        time.sleep(0.1)
    remove_cgroup_root(spec.cgroup_root)
    log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
