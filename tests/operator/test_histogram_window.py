"""TTFT p95 over a window from cumulative histograms: increases between scrapes, resets, quantiles."""

from __future__ import annotations

import math

import pytest

from flotilla.operator.autoscaling.histogram_window import WindowedHistogram, add, increase, quantile

INF = math.inf


def hist(*counts, bounds=(0.1, 0.5, 1.0, INF)):
    """Cumulative buckets from per-bucket counts."""
    total, out = 0.0, []
    for le, c in zip(bounds, counts, strict=True):
        total += c
        out.append((le, total))
    return tuple(out)


def test_quantile_interpolates_like_prometheus():
    # 10 observations: 5 in (0, 0.1], 5 in (0.1, 0.5]. p50 rank 5 -> 0.1; p95 rank 9.5 -> 0.1 + 0.4 * 0.9
    buckets = hist(5, 5, 0, 0)
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.95, buckets) == pytest.approx(0.46)


def test_quantile_in_the_inf_bucket_answers_the_last_finite_bound():
    assert quantile(0.95, hist(0, 0, 1, 9)) == 1.0


def test_quantile_of_nothing_is_none():
    assert quantile(0.95, hist(0, 0, 0, 0)) is None
    assert quantile(0.95, ()) is None


def test_increase_between_scrapes():
    assert increase(hist(1, 0, 0, 0), hist(3, 2, 0, 0)) == hist(2, 2, 0, 0)


def test_first_scrape_is_a_baseline():
    assert increase(None, hist(100, 0, 0, 0)) == hist(0, 0, 0, 0)


def test_counter_reset_counts_everything_since_the_restart():
    assert increase(hist(100, 50, 0, 0), hist(0, 2, 0, 0)) == hist(0, 2, 0, 0)


def test_add_refuses_different_bounds():
    with pytest.raises(ValueError):
        add(hist(1, 0, 0, 0), hist(1, 0, 0, bounds=(0.2, 0.5, 1.0, INF)))


def test_window_drops_old_increases():
    w = WindowedHistogram(window=10)
    w.observe(0, {"a": hist(0, 0, 0, 0)})
    w.observe(5, {"a": hist(0, 0, 10, 0)})  # 10 slow requests
    assert w.quantile(0.95) == pytest.approx(0.975)
    w.observe(10, {"a": hist(10, 0, 10, 0)})  # 10 fast ones
    assert w.quantile(0.5) == pytest.approx(0.1)
    w.observe(16, {"a": hist(10, 0, 10, 0)})  # the slow ones (t=5) left the window
    assert w.quantile(0.95) == pytest.approx(0.095)
    w.observe(21, {"a": hist(10, 0, 10, 0)})
    assert w.quantile(0.95) is None


def test_window_sums_pods_and_survives_a_restart():
    w = WindowedHistogram(window=60)
    w.observe(0, {"a": hist(50, 0, 0, 0), "b": hist(0, 0, 0, 0)})
    # a restarted (its counts went down) and served 1 slow request; b served 19 fast ones
    w.observe(5, {"a": hist(0, 0, 1, 0), "b": hist(19, 0, 0, 0)})
    assert w.quantile(0.5) == pytest.approx(0.1 * 10 / 19)
    assert w.quantile(0.99) == pytest.approx(0.5 + 0.5 * (19.8 - 19))


def test_a_failed_scrape_is_not_taken_for_a_reset():
    w = WindowedHistogram(window=60)
    w.observe(0, {"a": hist(10, 0, 0, 0)})
    w.observe(5, {})  # a did not answer
    w.observe(10, {"a": hist(12, 0, 0, 0)})
    assert w.quantile(0.5) == pytest.approx(0.05)  # 2 new requests (rank 1 of 2), not 12


def test_forget_drops_baselines_of_gone_pods():
    w = WindowedHistogram(window=60)
    w.observe(0, {"a": hist(10, 0, 0, 0)})
    w.forget(set())
    w.observe(5, {"a": hist(11, 0, 0, 0)})  # a new pod of the same name: a baseline again
    assert w.quantile(0.5) is None
