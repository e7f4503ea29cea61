"""Failpoints: each name is placed in the code exactly once, an armed one kills the process at its step,
and an unknown name refuses the start (a misspelt chaos test would otherwise pass by dying nowhere)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flotilla.operator.controllers import failpoints

CONTROLLERS = Path(failpoints.__file__).parent


def test_every_failpoint_is_placed_once_and_every_placement_is_declared():
    placed: list[str] = []
    for path in CONTROLLERS.glob("*.py"):
        placed += re.findall(r'failpoints\.reached\("([^"]+)"\)', path.read_text())
    assert sorted(placed) == sorted(failpoints.POINTS)


def test_an_armed_failpoint_kills_the_process_at_its_step_and_no_other():
    code = (
        "from flotilla.operator.controllers import failpoints\n"
        "failpoints.reached('metering.counted')\n"
        "print('passed counted', flush=True)\n"
        "failpoints.reached('metering.written')\n"
        "print('passed written', flush=True)\n"
    )
    env = {**os.environ, failpoints.ENV: "metering.written"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL
    assert done.stdout.splitlines() == ["passed counted"]


def test_an_unknown_failpoint_is_refused_naming_the_known_ones(monkeypatch):
    monkeypatch.setenv(failpoints.ENV, "metering.cuonted")
    with pytest.raises(failpoints.UnknownFailpoint, match="metering.cuonted.*metering.counted"):
        failpoints.armed()
    monkeypatch.delenv(failpoints.ENV)
    assert failpoints.armed() is None
