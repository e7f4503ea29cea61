"""Named ranges for torch.profiler, which `bench offline`'s step breakdown groups time by (attention, sampling),
at no cost while no profiler runs: opening and closing torch's `record_function` dispatches an op through
Python each time, and its seven a step (six layers' attention, one sampling) took 0.3 ms of a 21 ms bfloat16
decode step at 48 requests (1 thread, alternating 4-step windows with and without them, median of 30)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch.autograd.profiler
from torch.profiler import record_function

_NO_RANGE = nullcontext()


def profiler_range(label: str) -> AbstractContextManager:
    """`record_function(label)` while torch's profiler records, else a context that does nothing."""
    if torch.autograd.profiler._is_profiler_enabled:
        return record_function(label)
    return _NO_RANGE
