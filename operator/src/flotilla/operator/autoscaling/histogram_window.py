"""A latency percentile over a recent window, from cumulative Prometheus histograms. Pure.

Engines export cumulative bucket counts since they started. A percentile of those is a lifetime
figure that barely moves; what users feel now is in the increase between scrapes. Each scrape's
increase (per pod, reset-aware, like PromQL's increase()) is kept with its time; the window's
percentile is histogram_quantile() over the sum of the increases inside it, across pods.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# (upper bound "le", cumulative count), sorted by bound, +Inf last.
Buckets = tuple[tuple[float, float], ...]


def increase(previous: Buckets | None, current: Buckets) -> Buckets:
    """What a pod observed between two scrapes. The first scrape is a baseline (its counts may be
    hours old); a count that went down means the process restarted, so all of `current` is new."""
    if previous is None or [le for le, _ in previous] != [le for le, _ in current]:
        return tuple((le, 0.0) for le, _ in current)
    if any(cur < prev for (_, prev), (_, cur) in zip(previous, current, strict=True)):
        return current
    return tuple((le, cur - prev) for (le, prev), (_, cur) in zip(previous, current, strict=True))


def add(a: Buckets, b: Buckets) -> Buckets:
    if not a:
        return b
    if not b:
        return a
    if [le for le, _ in a] != [le for le, _ in b]:
        raise ValueError("histograms with different bucket bounds cannot be added")
    return tuple((le, x + y) for (le, x), (_, y) in zip(a, b, strict=True))


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket holding the rank; a rank in the +Inf
    bucket answers the highest finite bound. None when the histogram is empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


@dataclass
class WindowedHistogram:
    """Per-pod previous scrapes plus the increases of the last `window` seconds."""

    window: float
    _last: dict[str, Buckets] = field(default_factory=dict)
    _increases: deque[tuple[float, Buckets]] = field(default_factory=deque)

    def observe(self, now: float, scraped: dict[str, Buckets]) -> None:
        """One round of scrapes: pod key -> cumulative buckets. Pods missing from `scraped` keep their
        last value, so a failed scrape is not mistaken for a reset on the next one."""
        total: Buckets = ()
        for pod, buckets in scraped.items():
            total = add(total, increase(self._last.get(pod), buckets))
            self._last[pod] = buckets
        self._increases.append((now, total))
        while self._increases and self._increases[0][0] <= now - self.window:
            self._increases.popleft()

    def forget(self, keep: set[str]) -> None:
        """Drop the baselines of pods that are gone."""
        for pod in set(self._last) - keep:
            del self._last[pod]

    def quantile(self, q: float) -> float | None:
        total: Buckets = ()
        for _, inc in self._increases:
            total = add(total, inc)
        return quantile(q, total)
