"""Failpoints: named steps at which a test has the operator die at once (SIGKILL: no handler, no cleanup)
to check that what it promises holds whichever step it dies at. Armed only by the environment variable
FLOTILLA_FAILPOINT, never by a flag or a chart value: a failpoint is a test's tool, as etcd's gofail
points are. An unknown name refuses the start, so a misspelt test never passes by dying nowhere."""

from __future__ import annotations

import logging
import os
import signal

ENV = "FLOTILLA_FAILPOINT"

POINTS = {
    "admission.reserved": "a quota reservation is written and the review not yet answered",
    "reconcile.applied": "a spec change's children are applied and the service's status not yet written",
    "metering.counted": "a metering round has counted and not yet written the Tenant's usage",
    "metering.written": "a metering round has written the usage and not yet released the ended pods",
    "autoscaling.scaled": "an autoscaler has written a new scale and not yet its status",
}

log = logging.getLogger("flotilla.operator.failpoints")


class UnknownFailpoint(ValueError):
    pass


def armed() -> str | None:
    """The failpoint this process is armed with, checked against POINTS (None: none)."""
    name = os.environ.get(ENV) or None
    if name is not None and name not in POINTS:
        raise UnknownFailpoint(f"{ENV}={name!r} names no failpoint; known: {', '.join(sorted(POINTS))}")
    return name


def reached(name: str) -> None:
    """Called at the step `name`: dies here when armed with it."""
    assert name in POINTS, name
    if os.environ.get(ENV) == name:
        log.warning("failpoint %s reached (%s): killing the operator", name, POINTS[name])
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
