"""Init containers and staged volumes in PodRuntime, with real processes and no cluster."""

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from flotilla.cluster import mount_ns
from flotilla.cluster.pod_runtime import PodRuntime
from flotilla.cluster.pod_status import pod_status
from flotilla.cluster.pod_volumes import PodVolumes
from flotilla.cluster.processes import ProcessTable
from flotilla.cluster.volume_contents import Sources


def _pod(init: list[dict], main: list[dict], policy: str = "Never", volumes: list | None = None) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "0123456789"},
        "spec": {
            "restartPolicy": policy,
            "initContainers": init,
            "containers": main,
            "volumes": volumes or [],
            "automountServiceAccountToken": False,
        },
    }


def _sh(name: str, script: str, **extra) -> dict:
    return {"name": name, "command": ["sh", "-c", script], **extra}


def _runtime(tmp_path: Path, pool, pod: dict, **kwargs) -> PodRuntime:
    return PodRuntime(
        pod,
        "127.0.0.1",
        "127.0.0.1",
        tmp_path / "logs",
        ProcessTable(tmp_path / "pids"),
        (lambda _ns, _n: None, lambda _ns, _n: None),
        pool,
        backoff_base=0.05,
        **kwargs,
    )


def _until(runtime: PodRuntime, predicate, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runtime.sync(time.monotonic())
        status = pod_status(runtime)
        if predicate(status):
            return status
        time.sleep(0.02)
    runtime.kill_now()
    raise AssertionError(f"condition not reached; last status {pod_status(runtime)}")


def _condition(status: dict, kind: str) -> str:
    return next(c["status"] for c in status["conditions"] if c["type"] == kind)


def test_init_containers_run_in_order_before_the_main_container(tmp_path):
    trace = tmp_path / "trace"
    pod = _pod(
        [_sh("one", f"echo one >> {trace}"), _sh("two", f"echo two >> {trace}")],
        [_sh("main", f"echo main >> {trace}")],
    )
    with ThreadPoolExecutor(1) as pool:
        runtime = _runtime(tmp_path, pool, pod)
        first = pod_status(runtime)
        assert first["phase"] == "Pending" and _condition(first, "Initialized") == "False"
        assert first["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"
        status = _until(runtime, lambda s: s["phase"] == "Succeeded")
    assert trace.read_text().split() == ["one", "two", "main"]
    assert _condition(status, "Initialized") == "True"
    for init in status["initContainerStatuses"]:
        assert init["state"]["terminated"]["reason"] == "Completed" and init["ready"] is True


def test_a_failing_init_container_is_retried_with_back_off(tmp_path):
    marker, trace = tmp_path / "failed-once", tmp_path / "trace"
    flaky = f"if [ -e {marker} ]; then exit 0; fi; touch {marker}; exit 3"
    pod = _pod([_sh("flaky", flaky)], [_sh("main", f"echo main >> {trace}")], policy="OnFailure")
    with ThreadPoolExecutor(1) as pool:
        runtime = _runtime(tmp_path, pool, pod)
        failed = _until(
            runtime,
            lambda s: s["initContainerStatuses"][0]["lastState"].get("terminated", {}).get("exitCode") == 3,
        )
        assert failed["phase"] == "Pending" and _condition(failed, "Initialized") == "False"
        done = _until(runtime, lambda s: s["phase"] == "Succeeded")
    assert done["initContainerStatuses"][0]["restartCount"] == 1
    assert trace.read_text().split() == ["main"]


def test_an_init_failure_under_restart_never_fails_the_pod(tmp_path):
    trace = tmp_path / "trace"
    pod = _pod(
        [_sh("bad", "exit 2"), _sh("later", f"echo later >> {trace}")], [_sh("main", f"echo m >> {trace}")]
    )
    with ThreadPoolExecutor(1) as pool:
        runtime = _runtime(tmp_path, pool, pod)
        status = _until(runtime, lambda s: s["phase"] == "Failed")
        for _ in range(5):
            runtime.sync(time.monotonic())
    assert status["initContainerStatuses"][0]["state"]["terminated"]["reason"] == "Error"
    assert "waiting" in status["initContainerStatuses"][1]["state"]
    assert _condition(status, "Initialized") == "False"
    assert not trace.exists()


def test_a_sidecar_init_container_keeps_running_beside_the_main_one(tmp_path):
    trace = tmp_path / "trace"
    sidecar = _sh("side", f"echo side >> {trace}; exec sleep 600", restartPolicy="Always")
    main = _sh("main", f"sleep 0.2; echo main >> {trace}; exec sleep 600")
    pod = _pod([sidecar], [main], policy="Always")
    with ThreadPoolExecutor(1) as pool:
        runtime = _runtime(tmp_path, pool, pod)
        status = _until(runtime, lambda s: s["phase"] == "Running" and _condition(s, "Ready") == "True")
        assert "running" in status["initContainerStatuses"][0]["state"]
        _until(runtime, lambda s: trace.exists() and "main" in trace.read_text())
        runtime.kill_now()
    assert trace.read_text().split() == ["side", "main"]


@pytest.mark.skipif(
    not mount_ns.available(sys.executable)[0], reason="mount namespaces need root and unshare"
)
def test_volumes_are_mounted_and_shared_between_init_and_main(tmp_path):
    inside = tmp_path / "inside"  # mount targets under tmp_path, so the host stays clean
    out = tmp_path / "out"
    volumes = [
        {"name": "shared", "emptyDir": {}},
        {"name": "cfg", "configMap": {"name": "settings"}},
        {"name": "results", "hostPath": {"path": str(out), "type": "DirectoryOrCreate"}},
    ]
    init = _sh(
        "init",
        f"echo from-init > {inside}/work/msg",
        volumeMounts=[{"name": "shared", "mountPath": f"{inside}/work"}],
    )
    main = _sh(
        "main",
        f"cat {inside}/work/msg {inside}/cfg/model > {inside}/res/seen; touch {inside}/cfg/x 2>> {inside}/res/seen; true",
        volumeMounts=[
            {"name": "shared", "mountPath": f"{inside}/work", "readOnly": True},
            {"name": "cfg", "mountPath": f"{inside}/cfg"},
            {"name": "results", "mountPath": f"{inside}/res"},
        ],
    )
    pod = _pod([init], [main], volumes=volumes)
    sources = Sources(
        lambda _ns, name: {"data": {"model": "tiny"}} if name == "settings" else None, lambda *_: None, str
    )
    with ThreadPoolExecutor(1) as pool:
        staged = PodVolumes(pod, tmp_path / "staged", sources, lambda: None, lambda *_: "")
        runtime = _runtime(tmp_path, pool, pod, volumes=staged, sandbox_python=sys.executable)
        _until(runtime, lambda s: s["phase"] in ("Succeeded", "Failed"))
    seen = (out / "seen").read_text()
    assert seen.startswith("from-init\ntiny"), (tmp_path / "logs" / "main.log").read_text()
    assert "Read-only file system" in seen
    assert not (inside / "work" / "msg").exists()  # only the containers saw the bind
    staged.cleanup()
    assert not (tmp_path / "staged").exists()


@pytest.mark.skipif(
    not mount_ns.available(sys.executable)[0], reason="mount namespaces need root and unshare"
)
def test_exec_probes_see_the_containers_mounts(tmp_path):
    inside = tmp_path / "inside"
    main = _sh(
        "main",
        f"touch {inside}/ok; exec sleep 600",
        volumeMounts=[{"name": "scratch", "mountPath": str(inside)}],
        readinessProbe={"exec": {"command": ["test", "-e", f"{inside}/ok"]}, "periodSeconds": 1},
    )
    pod = _pod([], [main], policy="Always", volumes=[{"name": "scratch", "emptyDir": {}}])
    sources = Sources(lambda *_: None, lambda *_: None, str)
    with ThreadPoolExecutor(1) as pool:
        staged = PodVolumes(pod, tmp_path / "staged", sources, lambda: None, lambda *_: "")
        runtime = _runtime(tmp_path, pool, pod, volumes=staged, sandbox_python=sys.executable)
        _until(runtime, lambda s: _condition(s, "Ready") == "True")
        runtime.kill_now()
    assert not (inside / "ok").exists()  # the file is in the emptyDir, seen only through the mount
    assert (tmp_path / "staged" / "scratch" / "ok").exists()
