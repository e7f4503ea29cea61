"""LoRA adapters through the HTTP API, with real clients: vLLM's load/unload endpoints, `model: <adapter>`
with the openai client, /v1/models, the per-adapter metrics; and every refusal (a rank above the maximum, a
module the model lacks, another model's shapes, a missing or corrupt file, a taken name, an adapter in use,
an unknown one) is a clear 4xx naming the field, the value and the limit, leaving nothing loaded."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ..lora.conftest import write_adapter
from .conftest import MODEL_NAME, ServerHandle, wait_for

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]  # token ids: what the reference is fed
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def base_model(tiny_model):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(base_model, tmp_path_factory):
    """name -> (folder, PEFT reference): two rank-8 adapters on different modules, one of rank 16."""
    made = {}
    for seed, (name, options) in enumerate(
        {
            "sql": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]},
            "chat": {"r": 8, "lora_alpha": 8, "target_modules": ["o_proj", "gate_proj", "up_proj"]},
            "wide": {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]},
        }.items(),
        start=10,
    ):
        folder = tmp_path_factory.mktemp(f"adapter-{name}")
        made[name] = (folder, write_adapter(base_model, folder, seed, **options))
    return made


def reference(model) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
            pad_token_id=0, attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        )  # fmt: skip
    return out[0, len(PROMPT) :].tolist()


@pytest.fixture(scope="module")
def lora_server(tiny_model, adapters):
    """One adapter at start (--lora-modules), one slot of rank 8 more: two slots in all, rank 8 at most."""
    handle = ServerHandle(
        tiny_model,
        {"max_num_seqs": 16, "lora_modules": {"sql": str(adapters["sql"][0])}, "max_loras": 2, "max_lora_rank": 8,
         "max_cpu_loras": 3},
    )  # fmt: skip
    yield handle
    handle.stop()


@pytest.fixture
def client(lora_server):
    with openai.OpenAI(
        base_url=f"{lora_server.url}/v1", api_key="none", http_client=httpx.Client(trust_env=False)
    ) as c:
        yield c
    lora_server.assert_no_leak()


def complete(client, model: str) -> tuple[str, str]:
    """The served text and the model the response names."""
    result = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return result.choices[0].text, result.model


def expected_text(server, reference_model) -> str:
    """What the reference generates, as the server's detokenizer writes it."""
    return server.llm.tokenizer.decode(reference(reference_model), skip_special_tokens=True)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, trust_env=False, timeout=60)


def model_ids(server) -> dict[str, dict]:
    cards = httpx.get(f"{server.url}/v1/models", trust_env=False).json()["data"]
    return {card["id"]: card for card in cards}


def test_the_base_and_an_adapter_answer_as_transformers_and_peft_do(
    lora_server, client, base_model, adapters
):
    cards = model_ids(lora_server)
    assert cards[MODEL_NAME]["parent"] is None
    assert cards["sql"]["parent"] == MODEL_NAME and cards["sql"]["root"] == str(adapters["sql"][0])
    assert reference(adapters["sql"][1]) != reference(base_model)  # the adapter changes the output
    assert complete(client, "sql") == (expected_text(lora_server, adapters["sql"][1]), "sql")
    assert complete(client, MODEL_NAME) == (expected_text(lora_server, base_model), MODEL_NAME)


def test_load_use_unload_and_reload_under_the_same_name_serves_the_new_weights(lora_server, client, adapters):
    """The second adapter named `x` must not find the first one's KV in the prefix cache."""
    folder_a, ref_a = adapters["chat"]
    assert (
        post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(folder_a)}).status_code
        == 200
    )
    assert model_ids(lora_server)["x"]["parent"] == MODEL_NAME
    assert complete(client, "x") == (expected_text(lora_server, ref_a), "x")
    assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 200
    assert "x" not in model_ids(lora_server)
    with pytest.raises(openai.NotFoundError) as gone:
        complete(client, "x")
    assert gone.value.status_code == 404 and "'x'" in str(gone.value)
    folder_b, ref_b = adapters["sql"]
    assert (
        post(lora_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(folder_b)}).status_code
        == 200
    )
    try:
        assert complete(client, "x") == (expected_text(lora_server, ref_b), "x")
    finally:
        assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 200


def broken_copies(adapters, base_model, tmp_path: Path) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """case -> (lora_path, the field the refusal names, words the message must contain)."""
    from safetensors.torch import load_file, save_file

    good = adapters["chat"][0]

    def copy(name: str) -> Path:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        return folder

    unknown_module = copy("unknown-module")
    config = json.loads((unknown_module / "adapter_config.json").read_text())
    config["target_modules"] = ["c_attn", "o_proj"]
    (unknown_module / "adapter_config.json").write_text(json.dumps(config))

    other_shapes = copy("other-shapes")
    tensors = load_file(str(other_shapes / "adapter_model.safetensors"))
    tensors = {k: (v[:, :32].contiguous() if "lora_A" in k else v) for k, v in tensors.items()}
    save_file(tensors, str(other_shapes / "adapter_model.safetensors"))

    corrupt = copy("corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00not a safetensors file")

    no_config = copy("no-config")
    (no_config / "adapter_config.json").unlink()

    return {
        "rank above the maximum": (str(adapters["wide"][0]), "r", ("rank 16", "--max-lora-rank", "(8)")),
        "a module the model lacks": (str(unknown_module), "target_modules", ("'c_attn'", "q_proj")),
        "another model's shapes": (str(other_shapes), "lora_path", ("[8, 32]", "64 input features")),
        "a corrupt weights file": (
            str(corrupt),
            "lora_path",
            ("adapter_model.safetensors", "not a readable"),
        ),
        "no adapter_config.json": (str(no_config), "lora_path", ("adapter_config.json", str(no_config))),
        "a missing folder": (
            str(tmp_path / "nowhere"),
            "lora_path",
            ("no such folder", str(tmp_path / "nowhere")),
        ),
    }


def test_every_bad_adapter_is_a_400_naming_field_value_and_limit_and_loads_nothing(
    lora_server, adapters, base_model, tmp_path
):
    before = model_ids(lora_server)
    for case, (path, field, words) in broken_copies(adapters, base_model, tmp_path).items():
        response = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": path})
        assert response.status_code == 400, (case, response.text)
        error = response.json()["error"]
        assert error["param"] == field, (case, error)
        assert error["type"] == "invalid_request_error"
        for word in words:
            assert word in error["message"], (case, word, error["message"])
        assert model_ids(lora_server) == before, f"{case} left something loaded"
    assert lora_server.llm.loras is not None and "broken" not in lora_server.llm.loras


def test_names_taken_unknown_and_in_use_are_refused_clearly(lora_server, client, adapters):
    sql_folder = str(adapters["sql"][0])
    taken = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": sql_folder})
    assert taken.status_code == 400 and "already loaded" in taken.json()["error"]["message"]
    base = post(lora_server, "/v1/load_lora_adapter", {"lora_name": MODEL_NAME, "lora_path": sql_folder})
    assert base.status_code == 400 and "base model" in base.json()["error"]["message"]
    unknown = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "nobody"})
    assert unknown.status_code == 404 and "'nobody'" in unknown.json()["error"]["message"]
    missing_field = post(lora_server, "/v1/load_lora_adapter", {"lora_name": "y"})
    assert missing_field.status_code == 400 and missing_field.json()["error"]["param"] == "lora_path"

    # An adapter that an unfinished request uses is not unloaded (409) and keeps serving it; once the
    # request ends, the unload succeeds. The engine's steps are held until the refusal, so the request is
    # certainly unfinished when the unload comes.
    assert (
        post(lora_server, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": sql_folder}).status_code
        == 200
    )
    runner = lora_server.llm.runner
    release = threading.Event()
    execute = runner.execute
    runner.execute = lambda out: (release.wait(60), execute(out))[1]
    try:
        stream = client.completions.create(
            model="busy", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        wait_for(lambda: lora_server.llm.lora_users("busy") == 1, what="the request to reach the engine")
        refused = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "busy"})
        assert refused.status_code == 409, refused.text
        assert "in use by 1 unfinished request" in refused.json()["error"]["message"]
    finally:
        release.set()
        del runner.execute
    text = "".join(chunk.choices[0].text for chunk in stream)
    assert text == expected_text(lora_server, adapters["sql"][1])
    wait_for(lambda: lora_server.llm.lora_users("busy") == 0, what="the busy adapter's request to end")
    assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "busy"}).status_code == 200


def test_more_adapters_than_slots_at_once_all_complete_with_their_own_weights(
    lora_server, client, adapters, base_model
):
    """Two slots, three adapters and the base, 12 requests at once: requests wait for a slot, none is
    refused, and each gets its own adapter's output."""
    for name in ("chat", "other"):
        folder = adapters["chat" if name == "chat" else "sql"][0]
        assert (
            post(
                lora_server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}
            ).status_code
            == 200
        )
    expected = {
        "sql": expected_text(lora_server, adapters["sql"][1]),
        "chat": expected_text(lora_server, adapters["chat"][1]),
        "other": expected_text(lora_server, adapters["sql"][1]),
        MODEL_NAME: expected_text(lora_server, base_model),
    }
    results: dict[int, tuple[str, str]] = {}
    names = list(expected) * 3

    def run(i: int) -> None:
        results[i] = complete(client, names[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(names))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    try:
        assert {i: results.get(i) for i in range(len(names))} == {
            i: (expected[n], n) for i, n in enumerate(names)
        }
        slots = lora_server.llm.scheduler.lora_slots
        assert slots is not None and slots.num_slots == 2 and not any(slots.users)
    finally:
        for name in ("chat", "other"):
            post(lora_server, "/v1/unload_lora_adapter", {"lora_name": name})


def test_per_adapter_metrics_count_requests_and_tokens(lora_server, client):
    def samples() -> dict[tuple[str, str], float]:
        text = httpx.get(f"{lora_server.url}/metrics", trust_env=False).text
        found = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("flotilla_lora_"):
                    found[(s.name, s.labels.get("lora_name", ""))] = s.value
                if s.name == "flotilla_lora_requests_info":
                    assert s.labels["max_lora"] == "2"
        return found

    before = samples()
    complete(client, "sql")
    after = samples()
    assert (
        after[("flotilla_lora_requests_total", "sql")] == before[("flotilla_lora_requests_total", "sql")] + 1
    )
    gained = (
        after[("flotilla_lora_generation_tokens_total", "sql")]
        - before[("flotilla_lora_generation_tokens_total", "sql")]
    )
    assert gained == MAX_TOKENS
    prompt = (
        after[("flotilla_lora_prompt_tokens_total", "sql")]
        - before[("flotilla_lora_prompt_tokens_total", "sql")]
    )
    assert prompt == len(PROMPT)
    assert ("flotilla_lora_requests_info", "") in after


def test_an_engine_with_an_internal_token_loads_and_unloads_only_for_callers_that_send_it(
    tiny_model, adapters
):
    from flotilla.contract import HEADER_INTERNAL_TOKEN

    handle = ServerHandle(tiny_model, {"enable_lora": True, "max_lora_rank": 8}, internal_token="secret")
    try:
        body = {"lora_name": "sql", "lora_path": str(adapters["sql"][0])}
        for headers in ({}, {HEADER_INTERNAL_TOKEN: "wrong"}):
            refused = httpx.post(
                f"{handle.url}/v1/load_lora_adapter", json=body, headers=headers, trust_env=False
            )
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "internal_token_required"
        assert "sql" not in model_ids(handle)
        good = {HEADER_INTERNAL_TOKEN: "secret"}
        loaded = httpx.post(
            f"{handle.url}/v1/load_lora_adapter", json=body, headers=good, trust_env=False, timeout=60
        )
        assert loaded.status_code == 200, loaded.text
        unload = {"lora_name": "sql"}
        refused = httpx.post(f"{handle.url}/v1/unload_lora_adapter", json=unload, trust_env=False)
        assert refused.status_code == 403 and "sql" in model_ids(handle)
        done = httpx.post(f"{handle.url}/v1/unload_lora_adapter", json=unload, headers=good, trust_env=False)
        assert done.status_code == 200 and "sql" not in model_ids(handle)
    finally:
        handle.stop()
