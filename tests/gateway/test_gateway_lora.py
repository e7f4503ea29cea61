"""LoRA adapters through the gateway, in front of real engines that serve them (docs/lora.md): `model:
<adapter>` goes only to replicas where the adapter is Loaded (per its LoRAAdapter's status), and to the
least loaded of them; only the adapter's tenant may use it (403 for another's, 404 for an unknown name);
/v1/models lists the caller's adapters with `parent`; a request for an adapter that is still loading is
held until the status says Loaded, and one that failed everywhere is refused at once. The fleet is hand-set
as in test_gateway.py: the watches' part is tests/gateway/test_adapters.py's."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from flotilla.bench.engine.lora import write_random_adapter
from flotilla.contract import (
    GATEWAY_REQUESTS,
    GATEWAY_RETRIES,
    HEADER_INTERNAL_TOKEN,
    REQUEST_SUCCESS,
    counter_total,
    engine_token,
)
from flotilla.gateway.core.adapters import AdapterView
from flotilla.gateway.core.services import ModelIndex, ServiceView

from ..engine.server.conftest import MODEL_NAME, wait_for
from .test_gateway import (
    ENGINE_TRUST,
    KEY_A,
    KEY_B,
    MASTER,
    HandSetFleet,
    assert_error,
    make_gateway,
    post,
    service,
    total,
)

__all__ = ["make_gateway"]  # the fixture, imported


# What the operator sends with a load: the namespace's internal token (engines refuse a load without it).
OPERATOR_HEADERS = {HEADER_INTERNAL_TOKEN: engine_token(MASTER, "ns-team-a")}


@pytest.fixture(scope="module")
def adapter_dir(tiny_model, tmp_path_factory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("adapters")
    config = transformers.AutoConfig.from_pretrained(str(tiny_model))
    for seed, name in enumerate(("sql", "late")):
        write_random_adapter(folder / name, config, rank=4, seed=seed)
    return folder


@pytest.fixture
def lora_engines(make_server, adapter_dir):
    """Two replicas of team-a's base service, both serving the adapter `sql` from the start."""
    kwargs = {"lora_modules": {"sql": str(adapter_dir / "sql")}, "max_loras": 2, "max_lora_rank": 8}
    return [make_server(kwargs, **ENGINE_TRUST) for _ in range(2)]


def lora(
    name: str, loaded: tuple[str, ...] = (), tenant: str = "team-a", service: str = "chat",
    failures: tuple[tuple[str, str], ...] = (), pending: int = 0,
) -> AdapterView:  # fmt: skip
    return AdapterView(f"ns-{tenant}", name, service, tenant, loaded_pods=frozenset(loaded), failures=failures,
                       pending=pending)  # fmt: skip


class LoRAFleet(HandSetFleet):
    def __init__(self, services: list[ServiceView], adapters: list[AdapterView]) -> None:
        super().__init__(services)
        self.set(services, adapters)

    def set(self, services: list[ServiceView], adapters: list[AdapterView]) -> None:
        self.index = ModelIndex(services, adapters)


def completion(model: str, key: str | None = KEY_A, gateway=None) -> httpx.Response:
    assert gateway is not None
    body = {"model": model, "prompt": "SELECT name FROM users WHERE", "max_tokens": 3, "ignore_eos": True}
    return post(gateway, body, key=key, path="/v1/completions")


def test_an_adapter_goes_only_to_replicas_where_it_is_loaded_and_only_for_its_tenant(
    lora_engines, make_gateway
):
    urls = [e.url for e in lora_engines]
    base_a, base_b = service("chat", urls), service("chat", [], tenant="team-b")
    # Both engines have `sql`, but the status says Loaded on chat-1 only: the gateway believes the status.
    fleet = LoRAFleet(
        [base_a, base_b], [lora("sql", ("chat-1",)), lora("secret", ("chat-0",), tenant="team-b")]
    )
    gateway = make_gateway(fleet, routing="least-load")
    before = [total(u, counter_total(REQUEST_SUCCESS)) for u in urls]
    for _ in range(3):
        rsp = completion("sql", gateway=gateway)
        assert rsp.status_code == 200, rsp.text
        assert rsp.json()["model"] == "sql"  # the engine served the adapter
    after = [total(u, counter_total(REQUEST_SUCCESS)) for u in urls]
    assert [b - a for a, b in zip(before, after, strict=True)] == [0, 3]
    assert completion("ns-team-a/sql", gateway=gateway).status_code == 200  # its namespace/name id
    # The base beside it still goes anywhere.
    assert completion(MODEL_NAME, gateway=gateway).status_code == 200

    # Another tenant's adapter: 404, as an unknown name.
    assert_error(completion("secret", gateway=gateway), 404, "model_not_found", "'secret'")
    assert_error(completion("sql", key=KEY_B, gateway=gateway), 404, "model_not_found")
    assert_error(completion("nope", gateway=gateway), 404, "model_not_found")

    # /v1/models: the caller's own adapters, each with its base's id as `parent`.
    def models(key: str) -> dict[str, dict]:
        rsp = httpx.get(
            gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, trust_env=False
        )
        return {m["id"]: m for m in rsp.json()["data"]}

    mine = models(KEY_A)
    assert set(mine) == {MODEL_NAME, "sql"} and mine["sql"]["parent"] == MODEL_NAME
    assert "parent" not in mine[MODEL_NAME]
    assert set(models(KEY_B)) == {MODEL_NAME, "secret"}

    # The tenant's metrics count adapter requests as any: by tenant, with the adapter's name as the model.
    assert total(gateway.url, counter_total(GATEWAY_REQUESTS), tenant="team-a", model="sql", code="200") == 4
    # A refused one names no model (another tenant's adapter is not the caller's to see in metrics either).
    assert total(gateway.url, counter_total(GATEWAY_REQUESTS), tenant="team-b", model="", code="404") == 1


def test_least_loaded_among_replicas_with_the_adapter(lora_engines, make_gateway):
    urls = [e.url for e in lora_engines]
    fleet = LoRAFleet([service("chat", urls)], [lora("sql", ("chat-0", "chat-1"))])
    gateway = make_gateway(fleet, routing="least-load")
    gateway.gateway.router.started(urls[0])  # chat-0 looks busy to the gateway
    before = [total(u, counter_total(REQUEST_SUCCESS)) for u in urls]
    for _ in range(2):
        assert completion("sql", gateway=gateway).status_code == 200
    after = [total(u, counter_total(REQUEST_SUCCESS)) for u in urls]
    assert [b - a for a, b in zip(before, after, strict=True)] == [0, 2]


def test_a_loading_adapter_is_held_until_loaded_and_a_failed_one_is_refused(
    lora_engines, adapter_dir, make_gateway
):
    engine = lora_engines[0]
    base = service("chat", [engine.url])
    fleet = LoRAFleet([base], [lora("late")])  # registered; the operator has not loaded it yet
    gateway = make_gateway(fleet, hold_timeout=60)
    results: dict[str, httpx.Response] = {}
    waiting = threading.Thread(target=lambda: results.update(late=completion("late", gateway=gateway)))
    waiting.start()
    wait_for(
        lambda: gateway.gateway.holds.held("ns-team-a/chat:late") >= 1,
        what="the request for a loading adapter to be held",
    )
    # What the operator does: load it into the replica, then report it Loaded there.
    loaded = httpx.post(engine.url + "/v1/load_lora_adapter", trust_env=False, headers=OPERATOR_HEADERS,
                        json={"lora_name": "late", "lora_path": str(adapter_dir / "late")})  # fmt: skip
    assert loaded.status_code == 200, loaded.text
    gateway.call_soon(lambda: (fleet.set([base], [lora("late", ("chat-0",))]), fleet.changed()))
    waiting.join(60)
    assert results["late"].status_code == 200 and results["late"].json()["model"] == "late"

    failed = lora("bad", failures=(("chat-0", "rank 128 is above the limit 8"),))
    fleet.set([base], [failed])
    assert_error(completion("bad", gateway=gateway), 503, "adapter_unavailable", "rank 128")
    fleet.set([base], [lora("orphan", service="gone")])
    assert_error(completion("orphan", gateway=gateway), 503, "adapter_unavailable", "'gone' does not exist")


def test_a_held_adapter_request_times_out_with_a_clear_503(make_gateway):
    # A replica that has not loaded it yet (never asked: the gateway does not load adapters itself).
    fleet = LoRAFleet([service("chat", ["http://127.0.0.1:9"])], [lora("sql", pending=1)])
    gateway = make_gateway(fleet, hold_timeout=0.2)
    assert_error(completion("sql", gateway=gateway), 503, "no_replica_ready", "adapter loaded", "0.2s")
    fleet.set([service("chat", [], desired_replicas=0)], [lora("sql")])  # the base at zero, for good
    assert_error(
        completion("sql", gateway=gateway), 503, "no_replicas", "'sql''s base service", "scaled to 0"
    )


def test_a_replica_that_lost_the_adapter_costs_a_retry_not_an_error(lora_engines, adapter_dir, make_gateway):
    """The status says Loaded on both, but only chat-1's engine has `late` (chat-0's engine restarted and
    the operator has not loaded it again yet): its 404 sends the request to the other replica."""
    loaded = httpx.post(lora_engines[1].url + "/v1/load_lora_adapter", trust_env=False, headers=OPERATOR_HEADERS,
                        json={"lora_name": "late", "lora_path": str(adapter_dir / "late")})  # fmt: skip
    assert loaded.status_code == 200, loaded.text
    fleet = LoRAFleet([service("chat", [e.url for e in lora_engines])], [lora("late", ("chat-0", "chat-1"))])
    gateway = make_gateway(fleet, routing="round-robin")
    urls = [e.url for e in lora_engines]
    before = [total(u, counter_total(REQUEST_SUCCESS)) for u in urls]
    for _ in range(4):
        rsp = completion("late", gateway=gateway)
        assert rsp.status_code == 200 and rsp.json()["model"] == "late", rsp.text
    after = [total(u, counter_total(REQUEST_SUCCESS)) for u in urls]
    assert [b - a for a, b in zip(before, after, strict=True)] == [0, 4]
    assert total(gateway.url, counter_total(GATEWAY_RETRIES), model="late") >= 1  # chat-0 was tried
