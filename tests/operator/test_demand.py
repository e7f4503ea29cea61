"""The demand annotation through the autoscaler's kopf layer, with a fake API: the handler wakes the
service's daemon at once, and one round scales a service at zero to one replica (or not, when stale)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import kopf
import pytest

from flotilla.contract import ANNOTATION_DEMAND
from flotilla.operator.config import OperatorConfig
from flotilla.operator.controllers import autoscaling
from flotilla.operator.controllers.state import Runtime

KEY = ("team-a", "chat")


class FakeCustom:
    def __init__(self) -> None:
        self.scales: list[int] = []
        self.statuses: list[dict] = []

    def patch_namespaced_custom_object_scale(self, group, version, namespace, plural, name, body) -> None:
        self.scales.append(body["spec"]["replicas"])


class FakeKube:
    def __init__(self) -> None:
        self.custom = FakeCustom()

    def patch_service_status(self, namespace, name, status) -> None:
        self.custom.statuses.append(status["autoscaling"])


def _stamp(age: float) -> str:
    return (datetime.now(UTC) - timedelta(seconds=age)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _service(replicas: int, demand: str | None) -> dict:
    meta: dict[str, Any] = {"name": "chat", "namespace": "team-a", "uid": "u-1", "generation": 1}
    if demand is not None:
        meta["annotations"] = {ANNOTATION_DEMAND: demand}
    return {
        "apiVersion": "flotilla.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": meta,
        "spec": {
            "model": {"uri": "file:///models/tiny"},
            "replicas": replicas,
            "autoscaling": {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 300},
        },
    }


@pytest.fixture
def events(monkeypatch) -> list[tuple[str, str]]:
    posted: list[tuple[str, str]] = []
    monkeypatch.setattr(kopf, "event", lambda obj, *, type, reason, message: posted.append((type, reason)))
    return posted


def _round(obj: dict) -> FakeCustom:
    kube = FakeKube()
    rt = Runtime(config=OperatorConfig(), kube=cast(Any, kube))
    indexes = {"services": {KEY: [obj]}, "pods": {}, "tenants": {}, "namespace_labels": {}}
    wait = asyncio.run(autoscaling._Daemon(rt, KEY).decide_once(None, indexes))
    assert wait == 15
    return kube.custom


def test_a_fresh_demand_at_zero_scales_to_one(events):
    custom = _round(_service(0, _stamp(2)))
    assert custom.scales == [1]
    (status,) = custom.statuses
    assert (status["reason"], status["desiredReplicas"]) == ("Demand", 1)
    assert ("Normal", "ScaledUp") in events


@pytest.mark.parametrize("demand", [None, "not a time", _stamp(301), _stamp(3600)])
def test_no_or_stale_demand_leaves_zero_alone(events, demand):
    custom = _round(_service(0, demand))
    assert custom.scales == []
    assert custom.statuses[0]["reason"] == "ScaledToZero"


def test_the_demand_handler_wakes_the_daemon_at_once():
    async def scenario() -> float:
        rt = Runtime(config=OperatorConfig(), kube=cast(Any, None))
        wake = rt.autoscaler_wake.setdefault(KEY, asyncio.Event())

        class NeverStopped:
            def wait(self, seconds: float):
                return asyncio.sleep(seconds)

        start = time.monotonic()
        pause = asyncio.ensure_future(autoscaling._pause(cast(Any, NeverStopped()), wake, 30))
        await asyncio.sleep(0.05)
        handler = cast(Any, autoscaling.demand_arrived)  # kopf's decorator types it as kopf calls it
        await handler(new=_stamp(0), namespace="team-a", name="chat", memo=kopf.Memo(runtime=rt))
        await asyncio.wait_for(pause, 5)
        assert not wake.is_set()  # cleared for the next wait
        return time.monotonic() - start

    assert asyncio.run(scenario()) < 5
