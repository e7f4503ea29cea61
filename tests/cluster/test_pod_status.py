"""When the node agent re-asserts a pod's status that someone else changed."""

from flotilla.cluster.pod_status import overwritten

OURS = {
    "phase": "Running",
    "podIP": "127.1.0.2",
    "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}],
}


def test_the_same_view_is_not_overwritten():
    extra = {**OURS, "conditions": [*OURS["conditions"], {"type": "DisruptionTarget", "status": "True"}]}
    assert not overwritten(OURS, OURS)
    assert not overwritten(extra, OURS)  # conditions others own are theirs to set


def test_a_ready_condition_flipped_by_the_node_controller_is_overwritten():
    flipped = {**OURS, "conditions": [{"type": "Ready", "status": "False"}, OURS["conditions"][1]]}
    assert overwritten(flipped, OURS)


def test_phase_and_ip_count():
    assert overwritten({**OURS, "phase": "Pending"}, OURS)
    assert overwritten({**OURS, "podIP": None}, OURS)
