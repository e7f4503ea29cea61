"""Admission reviews are answered while kopf's own executor is full.

kopf runs every sync handler on one executor; an operator that has just started (a rolling update, a
failover) fills it with the resume of every object it serves. A review queued there would outlive the API
server's webhook timeout, and the tenant's request would fail (failurePolicy Fail). Here kopf's executor is
held by a thread that does not return, and reviews go through kopf's own admission path
(`serve_admission_request`, with the operator's registry): each must still be answered, with its verdict.
The reviews chosen are refused before they read the API, so no cluster is needed; which thread runs them
is what is under test.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import kopf
import pytest
from kopf._cogs.structs import references  # kopf's admission path is internal; kopf is pinned
from kopf._core.engines.admission import serve_admission_request
from kopf._core.engines.indexing import OperatorIndexers
from kopf._core.reactor.inventory import ResourceMemories

from flotilla.operator.api.v1alpha1 import GROUP, LORA_ADAPTER, TENANT, VERSION
from flotilla.operator.controllers import webhook_reviews  # noqa: F401 (registers the review handlers)
from flotilla.operator.controllers.state import REVIEW_THREADS

# Longer than any review could take on a loaded machine, far shorter than "never".
ANSWER_WITHIN_S = 60

BAD_TENANT = {"metadata": {"name": "bad"}, "spec": {"gpuQuota": {"h100": -1}}}
BAD_ADAPTER = {
    "metadata": {"name": "bad", "namespace": "a", "uid": "u"},
    "spec": {"inferenceService": "chat", "source": "ftp://host/adapter"},
}


def _review(kind: references.Resource, obj: dict, uid: str) -> dict:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "resource": {"group": GROUP, "version": VERSION, "resource": kind.plural},
            "operation": "CREATE",
            "userInfo": {"username": "tenant"},
            "object": {"apiVersion": f"{GROUP}/{VERSION}", **obj},
        },
    }


async def _serve(requests: list[dict], reviews: ThreadPoolExecutor) -> tuple[list, int]:
    """The answers given while kopf's executor is held, and how many reviews were still waiting."""
    kinds = {
        references.Resource(GROUP, VERSION, TENANT.plural, kind=TENANT.kind, namespaced=False),
        references.Resource(GROUP, VERSION, LORA_ADAPTER.plural, kind=LORA_ADAPTER.kind, namespaced=True),
    }
    settings = kopf.OperatorSettings()
    kopfs = ThreadPoolExecutor(max_workers=1)
    settings.execution.executor = kopfs
    held = threading.Event()
    kopfs.submit(held.wait)  # kopf's only thread is busy, as a startup backlog keeps all of them
    insights = references.Insights()
    insights.webhook_resources.update(kinds)
    answers = [
        asyncio.ensure_future(
            serve_admission_request(
                request,
                settings=settings,
                memories=ResourceMemories(),
                memobase=kopf.Memo(reviews=reviews, admission=None),  # refused before any read
                registry=kopf.get_default_registry(),
                insights=insights,
                indices=OperatorIndexers().indices,
            )
        )
        for request in requests
    ]
    # Not wait_for: cancelling a review kopf runs on its executor waits for its thread, which waits for us.
    done, waiting = await asyncio.wait(answers, timeout=ANSWER_WITHIN_S)
    held.set()
    await asyncio.gather(*waiting)
    kopfs.shutdown(wait=True)
    return [a.result() for a in done], len(waiting)


def test_reviews_are_answered_while_kopfs_executor_is_full():
    requests = [_review(TENANT, BAD_TENANT, f"t{i}") for i in range(REVIEW_THREADS)]
    requests += [_review(LORA_ADAPTER, BAD_ADAPTER, f"l{i}") for i in range(REVIEW_THREADS)]
    with ThreadPoolExecutor(max_workers=REVIEW_THREADS) as reviews:
        answers, waiting = asyncio.run(_serve(requests, reviews))
    assert waiting == 0, f"{waiting} of {len(requests)} reviews waited for kopf's executor"
    by_uid = {a["response"]["uid"]: a["response"] for a in answers}
    assert sorted(by_uid) == sorted(r["request"]["uid"] for r in requests)
    for uid, response in by_uid.items():
        assert response["allowed"] is False, response
        assert response["status"]["code"] == 422, response
        message = response["status"]["message"]
        if uid.startswith("t"):
            assert message.startswith("tenant bad:") and "gpuQuota" in message, message
        else:
            assert message.startswith("LoRAAdapter a/bad:") and "ftp://host/adapter" in message, message


@pytest.mark.parametrize("handler_id", ["quota", "quota-scale", "tenant", "lora-adapter"])
def test_every_review_handler_is_a_coroutine_kopf_awaits_not_one_for_its_executor(handler_id):
    from kopf._core.actions.invocation import is_async_fn

    handlers = {h.id: h for h in kopf.get_default_registry()._webhooks.get_all_handlers()}  # noqa: SLF001
    assert is_async_fn(handlers[handler_id].fn), handler_id
