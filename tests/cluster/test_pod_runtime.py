"""A pod's processes, started by PodRuntime without a cluster."""

import os
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor

from flotilla.cluster.pod_runtime import PodRuntime
from flotilla.cluster.processes import ProcessTable


def _pod(command: list[str]) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "0123456789"},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "command": command}]},
    }


def _run_to_exit(runtime: PodRuntime, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runtime.sync(time.monotonic())
        run = runtime.containers[0]
        if run.terminated is not None or run.waiting_reason == "RunContainerError":
            return {"terminated": run.terminated, "waiting": run.waiting_message}
        time.sleep(0.05)
    raise AssertionError(f"the container did not exit within {timeout}s")


def test_pods_find_flotilla_when_the_agent_path_lacks_the_venv(tmp_path, monkeypatch):
    # As under `.venv/bin/flotilla cluster up` with the virtual environment not activated.
    scripts = os.path.normpath(sysconfig.get_path("scripts"))
    inherited = [
        p for p in os.environ.get("PATH", os.defpath).split(os.pathsep) if os.path.normpath(p) != scripts
    ]
    monkeypatch.setenv("PATH", os.pathsep.join(inherited))
    with ThreadPoolExecutor(1) as pool:
        runtime = PodRuntime(
            _pod(["flotilla", "--help"]),
            "127.0.0.1",
            "127.0.0.1",
            tmp_path / "logs",
            ProcessTable(tmp_path / "pids"),
            (lambda _ns, _n: None, lambda _ns, _n: None),
            pool,
        )
        outcome = _run_to_exit(runtime)
    assert outcome["terminated"] is not None, outcome["waiting"]
    assert outcome["terminated"]["exitCode"] == 0, (tmp_path / "logs" / "main.log").read_text()


def test_exec_probes_run_in_the_containers_environment():
    import os

    from flotilla.cluster.probes import run_probe

    probe = {"exec": {"command": ["sh", "-c", 'test "$PROBE_MARK" = ready']}, "timeoutSeconds": 10}
    path = {"PATH": os.environ.get("PATH", os.defpath)}
    assert run_probe(probe, "127.0.0.1", [], env={**path, "PROBE_MARK": "ready"})
    assert not run_probe(probe, "127.0.0.1", [], env={**path, "PROBE_MARK": "other"})
