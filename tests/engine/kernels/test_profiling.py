"""profiler_range: the ranges `bench offline`'s step breakdown reads are there while torch's profiler records,
and cost nothing (no range, no op) while it does not."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile

from flotilla.engine.kernels.profiling import profiler_range


def test_a_range_is_recorded_while_the_profiler_runs_and_nothing_is_opened_otherwise():
    x = torch.ones(4)
    assert isinstance(profiler_range("flotilla.test"), nullcontext)
    with profile(activities=[ProfilerActivity.CPU]) as prof, profiler_range("flotilla.test"):
        (x * 2).sum()
    names = [event.name for event in prof.events()]
    assert "flotilla.test" in names
    assert isinstance(profiler_range("flotilla.test"), nullcontext), "the profiler stopped: no range again"
