"""The kopf layer's part in InferencePools: a cluster without the CRD says so in the service's status,
and the pool's status write is conditional and never fails a reconcile. No Kubernetes API: a fake client."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
from kubernetes.client.exceptions import ApiException

from flotilla.operator.controllers import sync
from flotilla.operator.desired.inference_pool import PoolStatus
from flotilla.operator.metrics import SERVICES

KEY = ("team-a", "chat")
OBJ = {"metadata": {"namespace": "team-a", "name": "chat", "generation": 1}, "spec": {}, "status": {}}
STATUS = {
    "message": "",
    "conditions": [{"type": "Degraded", "status": "False", "reason": "Healthy", "message": ""}],
}
POOL = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "chat"}}
DEPLOYMENT = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "chat"}}


def _error(status: int, body: object) -> ApiException:
    exc = ApiException(status=status, reason="x")
    exc.body = body if isinstance(body, str) else json.dumps(body)
    return exc


NOT_SERVED = _error(404, {"kind": "Status", "message": "the server could not find the requested resource",
                          "reason": "NotFound", "details": {}, "code": 404})  # fmt: skip
NO_NAMESPACE = _error(404, {"kind": "Status", "message": 'namespaces "team-a" not found', "reason": "NotFound",
                            "details": {"name": "team-a", "kind": "namespaces"}, "code": 404})  # fmt: skip


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (NOT_SERVED, True),
        (_error(404, "404 page not found"), True),
        (NO_NAMESPACE, False),
        (_error(403, {"kind": "Status", "details": {}}), False),
    ],
    ids=["no-resource", "plain-404", "no-namespace", "forbidden"],
)
def test_a_missing_crd_is_told_from_a_missing_namespace(exc, expected):
    assert sync.not_served(exc) is expected


class FakeKube:
    def __init__(self, fail: dict[str, ApiException] | None = None, pool_error: ApiException | None = None):
        self.fail, self.pool_error = fail or {}, pool_error
        self.applied: list[str] = []
        self.statuses: list[dict] = []
        self.pool_statuses: list[tuple] = []

    def apply(self, obj: dict) -> None:
        if obj["kind"] in self.fail:
            raise self.fail[obj["kind"]]
        self.applied.append(obj["kind"])

    def patch_service_status(self, namespace: str, name: str, status: dict) -> None:
        self.statuses.append(status)

    def patch_pool_status(self, namespace: str, name: str, version: str, status: dict) -> None:
        if self.pool_error is not None:
            raise self.pool_error
        self.pool_statuses.append((namespace, name, version, status))


def _rt(kube: FakeKube):
    return SimpleNamespace(refused={}, written_status={}, kube=kube, lock=threading.Lock())


@pytest.fixture(autouse=True)
def _forget_the_series():
    yield
    SERVICES.forget(*KEY)


@pytest.fixture
def events(monkeypatch) -> list[tuple]:
    posted: list[tuple] = []
    monkeypatch.setattr(sync.kopf, "event", lambda obj, **kw: posted.append((kw["type"], kw["reason"])))
    return posted


def _result(pool_status=None):
    return SimpleNamespace(children=[DEPLOYMENT, POOL], status=STATUS, events=[], pool_status=pool_status)


def test_no_crd_degrades_the_service_with_the_remedy_and_applies_the_rest(events):
    kube = FakeKube(fail={"InferencePool": NOT_SERVED})
    rt = _rt(kube)
    with pytest.raises(sync.ApplyFailed):  # kopf retries it, backing off
        sync._write(rt, OBJ, _result(), KEY, apply=[DEPLOYMENT, POOL])  # type: ignore[arg-type]
    assert kube.applied == ["Deployment"]
    (status,) = kube.statuses
    assert (
        "--no-inference-pools" in status["message"]
        and "inferencepools.inference.networking.k8s.io" in status["message"]
    )
    degraded = status["conditions"][0]
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
    assert events == [("Warning", "ApplyFailed")]


def test_a_missing_namespace_still_ends_the_reconcile(events):
    rt = _rt(FakeKube(fail={"InferencePool": NO_NAMESPACE}))
    with pytest.raises(ApiException):
        sync._write(rt, OBJ, _result(), KEY, apply=[POOL])  # type: ignore[arg-type]


WRITE = PoolStatus(name="chat", namespace="team-a", resource_version="41", status={"parents": []})


def test_the_pool_status_is_written_at_the_version_it_was_read():
    kube = FakeKube()
    sync._write(_rt(kube), OBJ, _result(WRITE), KEY, apply=[])  # type: ignore[arg-type]
    assert kube.pool_statuses == [("team-a", "chat", "41", {"parents": []})]


@pytest.mark.parametrize("code", [404, 409, 403, 500])
def test_a_refused_pool_status_write_does_not_fail_the_reconcile(code):
    kube = FakeKube(pool_error=_error(code, {"kind": "Status"}))
    sync._write(_rt(kube), OBJ, _result(WRITE), KEY, apply=[])  # type: ignore[arg-type]
    assert kube.statuses  # the service's own status was written all the same
