"""A probe's timing as a kubelet keeps it, on a clock whose origin is near zero (a machine just booted)."""

from flotilla.cluster.probes import ProbeTracker


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_first_run_is_due_at_the_initial_delay_whatever_the_period_and_the_clocks_origin():
    clock = Clock(0.5)  # monotonic time counts from boot: half a second up
    tracker = ProbeTracker(
        {"periodSeconds": 3600, "initialDelaySeconds": 2}, started_at=clock.now, clock=clock
    )
    assert not tracker.due(clock.now)
    clock.now = 2.4
    assert not tracker.due(clock.now)  # 1.9 s after the start: the delay is 2 s
    clock.now = 2.5
    assert tracker.due(clock.now)


def test_later_runs_wait_a_period_after_the_last():
    clock = Clock(1.0)
    tracker = ProbeTracker({"periodSeconds": 10}, started_at=clock.now, clock=clock)
    assert tracker.due(clock.now)  # no initial delay: at once
    tracker.running = True
    assert not tracker.due(clock.now)  # one run at a time
    clock.now = 1.5
    tracker.record(False)
    assert tracker.failures == 1 and tracker.result is None
    clock.now = 11.4
    assert not tracker.due(clock.now)
    clock.now = 11.5
    assert tracker.due(clock.now)


def test_a_tracker_at_the_origin_itself_runs_at_once():
    clock = Clock(0.0)
    tracker = ProbeTracker({"periodSeconds": 1}, started_at=0.0, clock=clock)
    assert tracker.due(0.0)
