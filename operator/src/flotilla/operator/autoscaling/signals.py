"""What a metrics source tells the autoscaler about one service in one period, whichever the source."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Signals:
    waiting: dict[str, float]  # pod name -> requests waiting, for the pods that reported
    ttft_p95: float | None  # seconds over the TTFT window, across pods; None when no request finished
    kv_usage: float | None = None  # the highest of the pods
    errors: dict[str, str] = field(default_factory=dict)  # pod name -> why it did not report
    # For the idle rule (scale_to_zero.py), of the pods that reported: requests running, and lifetime
    # prompt + generation tokens (absent for a pod whose engine exports no token counters).
    running: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
