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


def _until(predicate, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_a_restarted_agent_adopts_running_containers_without_restarting_or_unreadying_them(tmp_path):
    import signal

    from flotilla.cluster.pod_status import pod_status
    from flotilla.cluster.processes import signal_group

    pod = _pod(["sleep", "600"])
    pod["spec"]["restartPolicy"] = "Always"
    pod["spec"]["containers"][0]["readinessProbe"] = {"exec": {"command": ["true"]}, "periodSeconds": 3600}
    lookups = (lambda _ns, _n: None, lambda _ns, _n: None)
    pids = ProcessTable(tmp_path / "pids")
    with ThreadPoolExecutor(2) as pool:
        first = PodRuntime(pod, "127.0.0.1", "127.0.0.1", tmp_path / "logs", pids, lookups, pool)
        second: PodRuntime | None = None
        try:
            _until(lambda: (first.sync(time.monotonic()), first.containers[0].ready)[1])
            reported = {**pod, "status": pod_status(first)}
            pid = first.containers[0].proc.pid
            # The first agent is gone (without stopping anything); a second one finds the pod in the API.
            second = PodRuntime(reported, "127.0.0.1", "127.0.0.1", tmp_path / "logs", pids, lookups, pool)
            assert second.adopt(time.monotonic()) == ["main"]
            second.sync(time.monotonic())
            status = pod_status(second)
            run = status["containerStatuses"][0]
            assert run["containerID"] == f"flotilla://{pid}"
            assert run["ready"] is True and run["restartCount"] == 0
            assert (
                run["state"]["running"]["startedAt"]
                == reported["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
            )
            assert status["startTime"] == reported["status"]["startTime"]
            # It ends under the second agent, which cannot read its exit status: said so, and restarted.
            signal_group(pid, signal.SIGKILL)
            _until(lambda: (second.sync(time.monotonic()), second.containers[0].restart_count == 1)[1])
            last = pod_status(second)["containerStatuses"][0]["lastState"]["terminated"]
            assert last["reason"] == "ContainerStatusUnknown" and "exit status" in last["message"]
            _until(lambda: (second.sync(time.monotonic()), second.containers[0].running)[1])
            assert second.containers[0].proc.pid != pid
        finally:
            for runtime in (first, second):
                if runtime is not None:
                    runtime.kill_now()
