"""Status and conditions computed from decisions and observed objects, without a cluster."""

from __future__ import annotations

from flotilla.operator.desired.status import Observed, compute_status, deployment_view, pod_view
from flotilla.operator.desired.validation import Problem
from flotilla.operator.tenancy.quota import QuotaDecision

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"
ADMITTED = QuotaDecision(2, True, "WithinQuota", "tenant team-a: 2 h100 GPUs granted; 2 of 8 in use")


def _deployment(replicas=2, ready=2, updated=2, generation=1, observed=1, conditions=()):
    return {
        "metadata": {"generation": generation},
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "observedGeneration": observed,
            "conditions": list(conditions),
        },
    }


def _pod(name, ip="127.0.1.2", ready=True, restarts=0, waiting=None, last_exit=None, unschedulable=None):
    cs = {"name": "engine", "ready": ready, "restartCount": restarts, "state": {}}
    if waiting:
        cs["state"] = {"waiting": {"reason": waiting, "message": "back-off"}}
    if last_exit is not None:
        cs["lastState"] = {"terminated": {"exitCode": last_exit, "reason": "Error"}}
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        conditions.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
        )
    return {
        "metadata": {"name": name},
        "status": {"podIP": ip, "conditions": conditions, "containerStatuses": [cs]},
    }


def _observed(**kw):
    base = dict(
        generation=3,
        problems=[],
        quota=ADMITTED,
        requested_replicas=2,
        desired_replicas=2,
        gpus_per_replica=1,
        selector="flotilla.dev/inferenceservice=chat",
        service_url="http://chat.team-a.svc:8000/v1",
        deployment=deployment_view(_deployment()),
        pods=[pod_view(_pod("a", "127.0.1.2")), pod_view(_pod("b", "127.0.1.3"))],
    )
    base.update(kw)
    return Observed(**base)


def _conds(status):
    return {c["type"]: c for c in status["conditions"]}


def test_all_ready():
    status = compute_status(_observed(), [], NOW)
    c = _conds(status)
    assert [t for t in c] == ["Ready", "Valid", "QuotaAdmitted", "Progressing", "Degraded"]
    assert c["Ready"]["status"] == "True" and c["Ready"]["message"] == "2/2 replicas ready"
    assert c["Valid"]["status"] == "True"
    assert c["QuotaAdmitted"]["status"] == "True"
    assert c["Progressing"]["status"] == "False" and c["Progressing"]["reason"] == "RolloutComplete"
    assert c["Degraded"]["status"] == "False"
    assert status["readyReplicas"] == 2 and status["replicas"] == 2 and status["desiredReplicas"] == 2
    assert status["endpoints"] == ["http://127.0.1.2:8000/v1", "http://127.0.1.3:8000/v1"]
    assert status["observedGeneration"] == 3 and status["gpus"] == 2
    assert status["selector"] == "flotilla.dev/inferenceservice=chat"
    assert all(cond["observedGeneration"] == 3 for cond in status["conditions"])


def test_invalid_spec_is_not_ready_and_says_why():
    problems = [Problem("spec.resources.gpuType", "no node has GPU type 'a100'", "UnknownGPUType")]
    status = compute_status(_observed(problems=problems, quota=None, deployment=None, pods=[]), [], NOW)
    c = _conds(status)
    assert c["Valid"]["status"] == "False" and c["Valid"]["reason"] == "UnknownGPUType"
    assert "spec.resources.gpuType: no node has GPU type 'a100'" in c["Valid"]["message"]
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "InvalidSpec"
    assert c["QuotaAdmitted"]["status"] == "Unknown"
    assert status["message"] == c["Valid"]["message"]


def test_quota_refusal_shows_in_status():
    refused = QuotaDecision(1, False, "QuotaExceeded", "tenant team-a: asked for 4 ... quota is 8")
    status = compute_status(_observed(quota=refused, requested_replicas=4, desired_replicas=1), [], NOW)
    c = _conds(status)
    assert c["QuotaAdmitted"]["status"] == "False" and c["QuotaAdmitted"]["reason"] == "QuotaExceeded"
    assert c["Degraded"]["reason"] == "QuotaLimited"
    assert status["message"] == refused.message


def test_rollout_in_progress():
    dep = deployment_view(_deployment(replicas=3, ready=2, updated=1, generation=2, observed=2))
    c = _conds(compute_status(_observed(deployment=dep), [], NOW))
    assert c["Progressing"]["status"] == "True" and c["Progressing"]["reason"] == "RollingOut"
    assert c["Ready"]["status"] == "True"  # old pods still serve: maxUnavailable is 0


def test_not_ready_yet():
    dep = deployment_view(_deployment(ready=1))
    pods = [pod_view(_pod("a")), pod_view(_pod("b", ip="127.0.1.3", ready=False))]
    status = compute_status(_observed(deployment=dep, pods=pods), [], NOW)
    c = _conds(status)
    assert c["Ready"]["status"] == "False" and c["Ready"]["message"] == "1/2 replicas ready"
    assert status["endpoints"] == ["http://127.0.1.2:8000/v1"]


def test_no_deployment_yet():
    c = _conds(compute_status(_observed(deployment=None, pods=[]), [], NOW))
    assert c["Progressing"]["reason"] == "Creating" and c["Ready"]["status"] == "False"


def test_crash_loop_is_degraded():
    pods = [pod_view(_pod("a")), pod_view(_pod("b", ready=False, restarts=4, waiting="CrashLoopBackOff"))]
    c = _conds(compute_status(_observed(pods=pods), [], NOW))
    assert c["Degraded"]["status"] == "True"
    assert "pod b: container engine: CrashLoopBackOff" in c["Degraded"]["message"]


def test_exited_engine_is_degraded_until_ready_again():
    crashed = pod_view(_pod("a", ready=False, restarts=1, last_exit=137))
    assert "exited with code 137" in crashed.trouble
    recovered = pod_view(_pod("a", ready=True, restarts=1, last_exit=137))
    assert recovered.trouble is None


def test_unschedulable_and_replica_failure_are_degraded():
    pods = [pod_view(_pod("a", ip=None, ready=False, unschedulable="0/3 nodes: Insufficient nvidia.com/gpu"))]
    dep = deployment_view(
        _deployment(
            ready=0,
            conditions=[
                {
                    "type": "ReplicaFailure",
                    "status": "True",
                    "reason": "FailedCreate",
                    "message": "exceeded quota",
                }
            ],
        )
    )
    c = _conds(compute_status(_observed(deployment=dep, pods=pods), [], NOW))
    assert c["Ready"]["status"] == "False"
    assert c["Degraded"]["status"] == "True"
    assert c["Degraded"]["message"].startswith("deployment: FailedCreate: exceeded quota")
    assert "Insufficient nvidia.com/gpu" in c["Degraded"]["message"]


def test_scaled_to_zero():
    dep = deployment_view(_deployment(replicas=0, ready=0, updated=0))
    zero = QuotaDecision(0, True, "WithinQuota", "")
    c = _conds(
        compute_status(
            _observed(desired_replicas=0, requested_replicas=0, quota=zero, deployment=dep, pods=[]), [], NOW
        )
    )
    assert c["Ready"]["reason"] == "ScaledToZero" and c["Progressing"]["status"] == "False"


def test_transition_time_moves_only_on_change():
    first = compute_status(_observed(), [], NOW)
    same = compute_status(_observed(), first["conditions"], LATER)
    assert _conds(same)["Ready"]["lastTransitionTime"] == NOW
    dep = deployment_view(_deployment(ready=0))
    unready = [pod_view(_pod("a", ready=False)), pod_view(_pod("b", ready=False))]
    changed = compute_status(_observed(deployment=dep, pods=unready), first["conditions"], LATER)
    assert _conds(changed)["Ready"]["lastTransitionTime"] == LATER
    assert _conds(changed)["Valid"]["lastTransitionTime"] == NOW


def test_terminating_pods_do_not_count():
    leaving = _pod("old")
    leaving["metadata"]["deletionTimestamp"] = NOW
    status = compute_status(_observed(pods=[pod_view(_pod("a")), pod_view(leaving)]), [], NOW)
    assert status["endpoints"] == ["http://127.0.1.2:8000/v1"] and status["gpus"] == 1


def test_apply_failures_show_as_degraded():
    from flotilla.operator.desired.status import with_apply_failures

    status = compute_status(_observed(), [], NOW)
    failed = with_apply_failures(
        status, ["Service chat: failed to allocate a serviceIP: range is full"], LATER
    )
    c = _conds(failed)
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "ApplyFailed"
    assert "range is full" in c["Degraded"]["message"] and c["Degraded"]["lastTransitionTime"] == LATER
    assert failed["message"].startswith("the API refused: Service chat")
    assert c["Ready"] == _conds(status)["Ready"]


def test_ready_follows_the_pods_not_the_lagging_deployment_counters():
    lagging = deployment_view(_deployment(ready=0))
    status = compute_status(_observed(deployment=lagging), [], NOW)
    assert _conds(status)["Ready"]["status"] == "True" and status["readyReplicas"] == 2
