"""Client disconnects, engine faults, /health while loading, and graceful drain on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from flotilla.cluster.handle import free_port

MODEL_NAME = "tiny"
BODY = {"model": MODEL_NAME, "prompt": "go on", "max_tokens": 200, "ignore_eos": True}


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, wait_for):
    aborted = server.llm.stats().finished_by_reason.get("abort", 0)
    with (
        httpx.Client(base_url=server.url, trust_env=False, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=BODY | {"stream": True}) as resp,
    ):
        lines = resp.iter_lines()
        next(lines)
        assert server.free_blocks() < server.total_blocks()  # it holds KV blocks now
    # leaving the block closed the connection mid-stream
    wait_for(lambda: server.llm.stats().finished_by_reason.get("abort", 0) == aborted + 1, what="the abort")


def test_disconnect_while_waiting_for_a_plain_response_aborts(server, wait_for):
    aborted = server.llm.stats().finished_by_reason.get("abort", 0)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        payload = httpx.Request(
            "POST", f"{server.url}/v1/completions", json=BODY | {"max_tokens": 240}
        ).read()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        sock.sendall(head.encode() + payload)
        wait_for(lambda: server.free_blocks() < server.total_blocks(), what="the request to start")
    wait_for(lambda: server.llm.stats().finished_by_reason.get("abort", 0) == aborted + 1, what="the abort")


def test_engine_fault_fails_requests_and_health(make_server):
    server = make_server()
    execute = server.llm.runner.execute
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("injected fault in a model step")
        return execute(sched)

    server.llm.runner.execute = flaky
    with httpx.Client(base_url=server.url, trust_env=False, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=BODY | {"stream": True}) as resp:
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert "injected fault" in events[-2] and '"code":"engine_error"' in events[-2]
        assert events[-1] == "data: [DONE]"
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        after = client.post("/v1/completions", json=BODY)
        assert after.status_code == 503 and after.json()["error"]["code"] == "dead"


def test_engine_fault_gives_500_to_a_plain_request(make_server):
    server = make_server()

    def broken(sched):
        raise RuntimeError("injected fault in a model step")

    server.llm.runner.execute = broken
    resp = httpx.post(f"{server.url}/v1/completions", json=BODY, trust_env=False, timeout=60)
    assert resp.status_code == 500
    assert (
        resp.json()["error"]["code"] == "engine_error" and "injected fault" in resp.json()["error"]["message"]
    )
    assert httpx.get(f"{server.url}/health", trust_env=False).status_code == 503


def test_health_is_503_while_loading(tiny_model, make_server, wait_for):
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.llm_engine import LLMEngine

    release = threading.Event()

    def slow_load():
        release.wait()
        return LLMEngine(EngineConfig(model=str(tiny_model), kv_cache_memory=1 << 20, show_progress=False))

    handle = make_server(wait=False, factory=slow_load)
    try:
        wait_for(lambda: _status(handle.url + "/health") == 503, what="the server to listen")
        assert httpx.get(f"{handle.url}/health", trust_env=False).json()["status"] == "loading"
        assert httpx.post(f"{handle.url}/v1/completions", json=BODY, trust_env=False).status_code == 503
        release.set()
        handle.wait_healthy()
    finally:
        release.set()


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, trust_env=False).status_code
    except httpx.TransportError:
        return None


def test_cli_refuses_a_bad_model_folder(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "engine", "serve", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "config.json" in proc.stderr


def test_sigterm_drains_in_flight_requests(tiny_model, wait_for):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A shutdown delay no stall can outlast, so the late request below is inside it however slow the
    # machine; a second SIGTERM then ends the delay (test_shutdown_delay_* covers the delay running out).
    cmd = [sys.executable, "-m", "flotilla.cli", "engine", "serve", "--model", str(tiny_model),
           "--port", str(port), "--served-model-name", MODEL_NAME, "--kv-cache-memory", "1MiB", "--log-level", "warning",
           "--shutdown-delay", "600"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: _status(url + "/health") == 200, what="the server to be healthy")
        with (
            httpx.Client(base_url=url, trust_env=False, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=BODY | {"stream": True}) as resp,
        ):
            lines = resp.iter_lines()
            next(lines)
            os.kill(proc.pid, signal.SIGTERM)
            wait_for(lambda: _status(url + "/health") != 200, what="health to stop answering 200")
            # Within --shutdown-delay a request routed here before endpoints caught up is still served.
            late = httpx.post(url + "/v1/completions", json=BODY, timeout=60, trust_env=False)
            assert late.status_code == 200, late.text
            os.kill(proc.pid, signal.SIGTERM)  # the second signal skips the rest of the delay
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        # uvicorn re-raises the signal once it has shut down cleanly: the process ends by SIGTERM.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read()
    assert "Traceback" not in log, log


class _RecordedTimer:
    """Stands in for threading.Timer: records the delay and callback; the test fires it."""

    made: list[_RecordedTimer] = []

    def __init__(self, interval, function, args=()) -> None:
        self.interval, self.function, self.args = interval, function, args
        self.started = False
        _RecordedTimer.made.append(self)

    def start(self) -> None:
        self.started = True

    def fire(self) -> None:
        self.function(*self.args)


def _draining_server(delay: float):
    import uvicorn

    from flotilla.engine.server.app import DrainingServer, ServerSettings, ServerState

    state = ServerState(ServerSettings(model_name=MODEL_NAME))
    return DrainingServer(uvicorn.Config(app=lambda *_: None), state, shutdown_delay=delay), state


def test_shutdown_delay_drops_readiness_at_once_and_stops_when_it_runs_out(monkeypatch):
    # The delay's clock is replaced by a recorded timer: what is checked is the order of events, which
    # no machine load can change, not how long anything took.
    monkeypatch.setattr(threading, "Timer", _RecordedTimer)
    _RecordedTimer.made.clear()
    server, state = _draining_server(5.0)
    server.handle_exit(signal.SIGTERM, None)
    assert state.draining
    assert not server.should_exit  # still serving during the delay
    (timer,) = _RecordedTimer.made
    assert timer.started and timer.interval == 5.0
    timer.fire()  # the delay ran out
    assert server.should_exit


def test_shutdown_delay_is_skipped_by_a_second_signal_or_when_zero(monkeypatch):
    monkeypatch.setattr(threading, "Timer", _RecordedTimer)
    _RecordedTimer.made.clear()
    server, _ = _draining_server(5.0)
    server.handle_exit(signal.SIGTERM, None)
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit
    immediate, state = _draining_server(0.0)
    immediate.handle_exit(signal.SIGTERM, None)
    assert immediate.should_exit and state.draining
    assert len(_RecordedTimer.made) == 1  # only the first signal with a delay started a timer


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--threads", "-1"], "argument --threads: must be 0 (the default count) or more, got -1"),
        (["--shutdown-delay", "-5"], "--shutdown-delay must be 0 seconds or more, got -5.0"),
        (["--drain-timeout", "-1"], "--drain-timeout must be 0 seconds or more, got -1.0"),
    ],
    ids=["threads", "shutdown-delay", "drain-timeout"],
)
def test_cli_refuses_bad_flags_before_listening(tiny_model, flags, words):
    proc = subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "engine", "serve", "--model", str(tiny_model), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
