"""The autoscaling rule on synthetic inputs: per-signal ratios, tolerance, windows, step limits, bounds,
quota, and HPA's conservative handling of missing metrics and pods that are not ready."""

from __future__ import annotations

from flotilla.operator.autoscaling.rule import (
    QUEUE,
    TTFT,
    Inputs,
    PodSample,
    Policy,
    Recommendation,
    queue_proposal,
    scale_target,
    stabilize,
    ttft_proposal,
)


def pods(*waiting, ready=True):
    return [PodSample(f"p{i}", ready, w) for i, w in enumerate(waiting)]


def policy(**kw):
    base = {"min_replicas": 1, "max_replicas": 10, "queue_depth_target": 4.0, "ttft_p95_target": 0.5}
    return Policy(**(base | kw))


def inputs(current, pod_list, *, ttft=None, complete=True, now=1000.0, history=(), quota_max=None, **kw):
    return Inputs(
        now=now,
        current=current,
        pods=pod_list,
        ttft_p95=ttft,
        ttft_complete=complete,
        policy=policy(**kw),
        history=history,
        quota_max=quota_max,
        quota_message="tenant team-a: quota 2",
    )


# ---- queue depth: AverageValue -------------------------------------------------------------------


def test_queue_scales_by_average_over_target():
    assert queue_proposal(pods(12, 8), target=4, current=2, tolerance=0.1) == 5  # 20 waiting / 4


def test_queue_within_tolerance_keeps_current():
    assert queue_proposal(pods(4.3, 4.2), target=4, current=2, tolerance=0.1) == 2


def test_queue_with_no_ready_metrics_gives_no_proposal():
    assert queue_proposal(pods(None, None), target=4, current=2, tolerance=0.1) is None
    assert queue_proposal(pods(10, ready=False), target=4, current=1, tolerance=0.1) is None


def test_missing_pod_counts_as_on_target_when_scaling_down():
    # One pod says idle, the other did not answer: HPA assumes the silent one is exactly on target.
    # ratio (0 + 4) / 2 / 4 = 0.5 -> ceil(0.5 * 2) = 1, not the 0 the answering pod alone suggests.
    assert queue_proposal(pods(0, None), target=4, current=2, tolerance=0.1) == 1


def test_missing_pods_count_as_idle_when_scaling_up():
    # (16 + 0 + 0) / 3 / 4 = 1.33 -> 4 (the answering pod alone would say 4 as well, but scaled by 1 pod)
    assert queue_proposal(pods(16, None, None), target=4, current=3, tolerance=0.1) == 4


def test_missing_pods_that_flip_the_direction_hold():
    # 6/4 = 1.5 says up; counting 3 silent pods as idle gives 6/4/4 = 0.375: flipped, so hold.
    assert queue_proposal(pods(6, None, None, None), target=4, current=4, tolerance=0.1) == 4


def test_unready_pods_count_as_idle_on_scale_up():
    pod_list = [PodSample("a", True, 16), PodSample("b", False, None)]
    # Alone: 16/4 -> 4 replicas. With the starting pod as idle: 16/2/4 = 2 -> ceil(2 * 2) = 4.
    assert queue_proposal(pod_list, target=4, current=2, tolerance=0.1) == 4
    pod_list = [PodSample("a", True, 12), PodSample("b", False, None), PodSample("c", False, None)]
    # 12/3/4 = 1.0: the new pods will absorb it, so no further scale-up.
    assert queue_proposal(pod_list, target=4, current=3, tolerance=0.1) == 3


def test_unready_pods_are_ignored_on_scale_down():
    pod_list = [PodSample("a", True, 0), PodSample("b", False, None)]
    assert queue_proposal(pod_list, target=4, current=2, tolerance=0.1) == 0


# ---- TTFT: Value semantics -----------------------------------------------------------------------


def test_ttft_scales_ready_replicas_by_ratio():
    assert ttft_proposal(1.5, target=0.5, ready=2, current=2, complete=True, tolerance=0.1) == 6
    assert ttft_proposal(0.1, target=0.5, ready=5, current=5, complete=True, tolerance=0.1) == 1


def test_ttft_without_requests_gives_no_proposal():
    assert ttft_proposal(None, target=0.5, ready=2, current=2, complete=True, tolerance=0.1) is None


def test_ttft_low_with_a_silent_pod_never_scales_down():
    assert ttft_proposal(0.1, target=0.5, ready=3, current=3, complete=False, tolerance=0.1) == 3


def test_ttft_high_while_new_pods_start_does_not_go_below_current():
    # 1 ready of 3: ceil(1 * 1.6) = 2 < 3 while the ratio says up -> hold at 3
    assert ttft_proposal(0.8, target=0.5, ready=1, current=3, complete=True, tolerance=0.1) == 3


# ---- scale_target: combining, windows, limits ---------------------------------------------------------


def test_takes_the_larger_signal():
    out = scale_target(inputs(2, pods(4, 4), ttft=1.5))  # queue on target (2), ttft 3x -> 6
    assert out.proposals == {QUEUE: 2, TTFT: 6}
    assert (out.desired, out.reason) == (6, "ScaleUp")
    assert "ttft p95 1.500s" in out.message and "2 -> 6 replicas" in out.message


def test_no_metrics_at_all_holds_even_above_min():
    out = scale_target(inputs(5, pods(None, None, None, None, None)))
    assert (out.desired, out.reason, out.recommendation) == (5, "NoMetrics", None)
    assert not out.active


def test_no_metrics_still_keeps_the_bounds():
    out = scale_target(inputs(12, pods(None), max_replicas=10))
    assert (out.desired, out.limited_by) == (10, "MaxReplicas")


def test_a_failed_scrape_never_drops_to_min():
    # Two pods idle, two silent: the silent ones count as on target, so at most a partial scale-down.
    out = scale_target(inputs(4, pods(0, 0, None, None), scale_down_window=0))
    assert out.desired == 2
    out = scale_target(inputs(4, pods(0, None, None, None), scale_down_window=0))
    assert out.desired == 3


def test_scale_up_step_limit_is_double_or_plus_four():
    out = scale_target(inputs(1, pods(100), max_replicas=100))
    assert (out.recommendation, out.desired, out.limited_by) == (25, 5, "ScaleUpLimit")  # 1 + 4
    out = scale_target(inputs(10, pods(*[40] * 10), max_replicas=1000))
    assert (out.desired, out.limited_by) == (20, "ScaleUpLimit")  # 2 x 10


def test_bounds_clamp():
    assert scale_target(inputs(3, pods(40, 40, 40), max_replicas=4)).desired == 4
    out = scale_target(inputs(3, pods(0, 0, 0), min_replicas=2, scale_down_window=0))
    assert (out.desired, out.limited_by) == (2, "MinReplicas")


def test_scale_down_keeps_the_highest_recommendation_in_the_window():
    history = (Recommendation(800.0, 5), Recommendation(950.0, 4))
    out = scale_target(inputs(5, pods(0, 0, 0, 0, 0), history=history, now=1000.0, scale_down_window=300))
    assert (out.recommendation, out.desired, out.reason) == (0, 5, "Stabilized")
    # Once the 5 leaves the window, the 4 still holds.
    out = scale_target(inputs(5, pods(0, 0, 0, 0, 0), history=history, now=1101.0, scale_down_window=300))
    assert out.desired == 4
    out = scale_target(inputs(5, pods(0, 0, 0, 0, 0), history=history, now=1251.0, scale_down_window=300))
    assert (out.desired, out.reason) == (1, "ScaleDown")


def test_scale_up_window_takes_the_lowest():
    history = (Recommendation(990.0, 2),)
    out = scale_target(inputs(2, pods(16, 16), history=history, scale_up_window=30))
    assert (out.recommendation, out.desired) == (8, 2)
    out = scale_target(inputs(2, pods(16, 16), history=history, scale_up_window=0))
    assert (out.desired, out.limited_by) == (6, "ScaleUpLimit")  # 8, but at most 2 + 4 in one step


def test_stabilize_never_moves_against_the_recommendation():
    p = policy(scale_up_window=60, scale_down_window=60)
    history = (Recommendation(990.0, 3),)
    assert stabilize(5, 4, history, 1000.0, p) == 4  # up window's lowest is 3 < current: stay
    assert stabilize(1, 2, history, 1000.0, p) == 2  # down window's highest is 3 > current: stay


def test_history_is_pruned_to_the_longest_window():
    history = (Recommendation(100.0, 9), Recommendation(990.0, 2))
    out = scale_target(inputs(2, pods(8, 8), history=history, scale_down_window=60))
    assert [r.time for r in out.history] == [990.0, 1000.0]


def test_quota_caps_scale_up_and_says_so():
    out = scale_target(inputs(1, pods(20), quota_max=2))
    assert (out.recommendation, out.desired, out.quota_limited) == (5, 2, True)
    assert out.limited_by == "QuotaLimited" and "tenant team-a: quota 2" in out.message


def test_quota_never_removes_running_replicas():
    out = scale_target(inputs(3, pods(20, 20, 20), quota_max=1))
    assert (out.desired, out.quota_limited) == (3, True)


def test_quota_does_not_flag_when_it_does_not_bind():
    out = scale_target(inputs(1, pods(8), quota_max=4))
    assert (out.desired, out.quota_limited) == (2, False)


def test_within_tolerance_is_steady():
    out = scale_target(inputs(2, pods(4.2, 4.0), ttft=0.52))
    assert (out.desired, out.reason) == (2, "Steady")
