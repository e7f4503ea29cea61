"""The pod status the agent reports: phase, conditions, IPs, init and main container statuses.

kubectl derives its STATUS column from these: `Init:0/2` while init containers run, `Init:Error` when
one's last run failed, `Init:CrashLoopBackOff` while one waits to be restarted, `PodInitializing` after.
"""

from __future__ import annotations

from flotilla.cluster.pod_runtime import ContainerRun, PodRuntime


def container_status(run: ContainerRun) -> dict:
    # A finished init container counts as ready, as the kubelet reports it.
    ready = run.ready or (run.init and run.done and not run.sidecar)
    status = {
        "name": run.name,
        "image": run.spec.get("image") or "local",
        "imageID": "",
        "ready": ready,
        "started": run.started,
        "restartCount": run.restart_count,
    }
    if run.running:
        status["state"] = {"running": {"startedAt": run.started_at}}
        status["containerID"] = f"flotilla://{run.proc.pid}"
    elif run.terminated is not None and not run.waiting_reason:
        status["state"] = {"terminated": run.terminated}
    else:
        waiting = {"reason": run.waiting_reason or "ContainerCreating"}
        if run.waiting_message:
            waiting["message"] = run.waiting_message
        status["state"] = {"waiting": waiting}
    last = run.terminated if run.waiting_reason and run.terminated else run.last_terminated
    status["lastState"] = {"terminated": last} if last else {}
    return status


def phase(runtime: PodRuntime) -> str:
    if runtime.init_failed:
        return "Failed"
    if not runtime.initialized:
        return "Pending"
    runs = runtime.containers
    if any(r.running for r in runs):
        return "Running"
    finished = [r.terminated for r in runs]
    policy = runtime.restart_policy
    if all(t is not None for t in finished) and all(not r.waiting_reason for r in runs):
        if all(t["exitCode"] == 0 for t in finished):
            return "Succeeded"
        if policy == "Never":
            return "Failed"
    if any(r.started_at for r in runs):
        return "Running"
    return "Pending"


def _condition(kind: str, ok: bool, reason: str = "", message: str = "") -> dict:
    condition = {"type": kind, "status": "True" if ok else "False"}
    if reason and not ok:
        condition["reason"] = reason
    if message and not ok:
        condition["message"] = message
    return condition


def _initialized(runtime: PodRuntime) -> dict:
    pending = [r.name for r in runtime.init_containers if not (r.done or (r.sidecar and r.started))]
    if runtime.initialized or not pending:
        return _condition("Initialized", True)
    return _condition(
        "Initialized",
        False,
        "ContainersNotInitialized",
        f"containers with incomplete status: [{' '.join(pending)}]",
    )


def pod_status(runtime: PodRuntime) -> dict:
    statuses = [container_status(run) for run in runtime.containers]
    sidecars_ready = all(run.ready for run in runtime.init_containers if run.sidecar)
    all_ready = all(s["ready"] for s in statuses) and sidecars_ready and runtime.initialized
    current_phase = phase(runtime)
    not_ready = "PodCompleted" if current_phase in ("Succeeded", "Failed") else "ContainersNotReady"
    status = {
        "phase": current_phase,
        "hostIP": runtime.host_ip,
        "hostIPs": [{"ip": runtime.host_ip}],
        "podIP": runtime.pod_ip,
        "podIPs": [{"ip": runtime.pod_ip}],
        "startTime": runtime.start_time,
        "conditions": [
            _condition(
                "PodReadyToStartContainers", not runtime.volume_problem, "FailedMount", runtime.volume_problem
            ),
            _initialized(runtime),
            _condition("ContainersReady", all_ready, not_ready),
            _condition("Ready", all_ready, not_ready),
        ],
        "containerStatuses": statuses,
    }
    if runtime.init_containers:
        status["initContainerStatuses"] = [container_status(run) for run in runtime.init_containers]
    return status


def simulated_status(pod: dict, pod_ip: str, host_ip: str, start_time: str) -> dict:
    """--simulate: Running and Ready at once, no process."""
    statuses = [
        {
            "name": c["name"],
            "image": c.get("image") or "local",
            "imageID": "",
            "ready": True,
            "started": True,
            "restartCount": 0,
            "state": {"running": {"startedAt": start_time}},
            "lastState": {},
        }
        for c in pod["spec"]["containers"]
    ]
    return {
        "phase": "Running",
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": start_time,
        "conditions": [
            _condition(t, True)
            for t in ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")
        ],
        "containerStatuses": statuses,
    }


def overwritten(observed: dict, ours: dict) -> bool:
    """Whether someone else changed what the agent reported: the phase, the pod IP or a condition's
    status. The node lifecycle controller marks pods NotReady when a node misses its lease; a kubelet
    re-asserts its own view once it is back, and so must the agent."""

    def view(status: dict) -> tuple:
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        return status.get("phase"), status.get("podIP"), conditions

    mine = view(ours)
    theirs = view(observed)
    return mine[:2] != theirs[:2] or any(theirs[2].get(k) != v for k, v in mine[2].items())
