"""LoRA adapters loaded from a URI (lora/source.py): `POST /v1/load_lora_adapter` with an http(s) tar archive
or an hf:// repository as lora_path, served by a loopback HTTP server (a fake Hub as well: nothing leaves
127.0.0.1). The engine fetches the adapter into its cache folder once per URI, serves what the same folder
loaded by path serves, shows the URI without its secrets, and refuses a bad scheme, a bad checksum or a
download that is no adapter with a 400 naming lora_path and the value, leaving nothing in the cache."""

from __future__ import annotations

import hashlib
import threading
import urllib.request
from pathlib import Path

import httpx
import pytest
import torch

from ..lora.conftest import write_adapter
from ..model.test_model_fetch import (
    MODEL_FILES,
    FakeServer,
    files_in,
    free_port,
    hub_env,
    server,
    tar_archive,
)
from .conftest import MODEL_NAME, ServerHandle, wait_for

__all__ = ["hub_env", "server"]  # the fake server and the Hub's environment, as test_model_fetch.py has them

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter_folder(tiny_model, tmp_path_factory) -> Path:
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("adapter-url")
    write_adapter(base, folder, 21, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    return folder


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora-cache") / "adapters"


@pytest.fixture(scope="module")
def engine(tiny_model, cache_dir):
    handle = ServerHandle(
        tiny_model,
        {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 8,
         "lora_cache_dir": str(cache_dir)},
    )  # fmt: skip
    yield handle
    handle.stop()


@pytest.fixture(autouse=True)
def unload_all(engine):
    """Each test starts with no adapter loaded (the cache stays: it lives as long as the engine)."""
    yield
    for name in list(engine.llm.loras.names()):
        assert post(engine, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def post(engine, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{engine.url}{path}", json=body, trust_env=False, timeout=60)


def load(engine, name: str, lora_path: str) -> httpx.Response:
    return post(engine, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": lora_path})


def roots(engine) -> dict[str, str]:
    cards = httpx.get(f"{engine.url}/v1/models", trust_env=False).json()["data"]
    return {card["id"]: card["root"] for card in cards if card["parent"]}


def complete(engine, model: str) -> str:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{engine.url}/v1/completions", json=body, trust_env=False, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def adapter_files(folder: Path) -> dict[str, bytes]:
    return files_in(folder)


def archive_gets(server: FakeServer, name: str) -> int:
    return server.requests.count(f"GET /archives/{name}")


def cache_entries(cache_dir: Path) -> set[str]:
    return {entry.name for entry in cache_dir.iterdir()} if cache_dir.exists() else set()


def test_an_archive_by_url_serves_what_the_same_folder_serves_by_path(
    engine, server, adapter_folder, cache_dir
):
    archive = tar_archive(adapter_files(adapter_folder), top="sql-adapter")
    server.archives["sql.tar.gz"] = archive
    sha = hashlib.sha256(archive).hexdigest()
    # A presigned URL: its query is a credential, shown nowhere.
    uri = f"{server.url}/archives/sql.tar.gz?X-Amz-Signature=secret#sha256={sha}"
    before = cache_entries(cache_dir)

    assert load(engine, "by-path", str(adapter_folder)).status_code == 200
    response = load(engine, "by-url", uri)
    assert response.status_code == 200, response.text
    assert archive_gets(server, "sql.tar.gz") == 1

    shown = f"{server.url}/archives/sql.tar.gz?…#sha256={sha}"
    assert roots(engine) == {"by-path": str(adapter_folder), "by-url": shown}
    (fetched,) = cache_entries(cache_dir) - before  # one folder, named by the URI's hash
    assert "secret" not in fetched and "sql" not in fetched
    assert files_in(cache_dir / fetched) == adapter_files(adapter_folder)

    by_path = complete(engine, "by-path")
    assert complete(engine, "by-url") == by_path != complete(engine, MODEL_NAME)

    # Unloaded and loaded again (or under another name), the URI is read from the cache: no second download.
    assert post(engine, "/v1/unload_lora_adapter", {"lora_name": "by-url"}).status_code == 200
    assert load(engine, "by-url", uri).status_code == 200
    assert load(engine, "again", uri).status_code == 200
    assert archive_gets(server, "sql.tar.gz") == 1
    assert complete(engine, "again") == by_path


def test_a_hub_repository_by_hf_uri_serves_what_the_same_folder_serves(engine, server, adapter_folder):
    server.repos["org/sql-adapter"] = adapter_files(adapter_folder)
    response = load(engine, "hub", "hf://org/sql-adapter@v1")
    assert response.status_code == 200, response.text
    assert "v1" in server.revisions
    assert roots(engine) == {"hub": "hf://org/sql-adapter@v1"}
    assert load(engine, "by-path", str(adapter_folder)).status_code == 200
    assert complete(engine, "hub") == complete(engine, "by-path")


def test_lora_modules_at_start_may_name_a_uri(engine, tiny_model, server, adapter_folder, tmp_path):
    server.archives["boot.tar.gz"] = tar_archive(adapter_files(adapter_folder))
    uri = f"{server.url}/archives/boot.tar.gz"
    cache = tmp_path / "cache"
    started = ServerHandle(
        tiny_model, {"lora_modules": {"boot": uri}, "max_lora_rank": 8, "lora_cache_dir": str(cache)}
    )
    try:
        assert roots(started) == {"boot": uri}
        assert load(engine, "by-path", str(adapter_folder)).status_code == 200
        assert complete(started, "boot") == complete(engine, "by-path")
        assert [entry.name for entry in cache.iterdir()] == [started.llm.lora_sources.folder_for(uri).name]
    finally:
        started.stop()


def test_a_file_uri_reads_the_folder_in_place(engine, adapter_folder, cache_dir):
    before = cache_entries(cache_dir)
    assert load(engine, "file", f"file://{adapter_folder}").status_code == 200
    assert roots(engine) == {"file": str(adapter_folder)}
    assert cache_entries(cache_dir) == before


def test_concurrent_loads_of_one_uri_fetch_it_once(engine, server, adapter_folder, monkeypatch):
    """The second load waits for the first one's fetch (one lock per URI), then reads its folder; the engine
    serves on while the download is held."""
    server.archives["shared.tgz"] = tar_archive(adapter_files(adapter_folder))
    uri = f"{server.url}/archives/shared.tgz"
    sources = engine.llm.lora_sources
    resolve, entered = sources.resolve, []
    gate = threading.Event()

    def gated(lora_path: str):
        entered.append(lora_path)
        return resolve(lora_path)

    # The first fetch's download is held until both loads are inside resolve (the second behind the lock).
    urlopen = urllib.request.urlopen

    def held_urlopen(*args, **kwargs):
        assert gate.wait(60)
        return urlopen(*args, **kwargs)

    monkeypatch.setattr(sources, "resolve", gated)
    monkeypatch.setattr(urllib.request, "urlopen", held_urlopen)
    answers: dict[str, int] = {}

    def load_as(name: str) -> None:
        answers[name] = load(engine, name, uri).status_code

    threads = [threading.Thread(target=load_as, args=(name,)) for name in ("one", "two")]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(entered) >= 2, what="both loads to be resolving the URI")
        # The download runs off the engine's thread: the base model answers meanwhile.
        complete(engine, MODEL_NAME)  # asserts a 200
    finally:
        gate.set()
    for thread in threads:
        thread.join(60)
    assert answers == {"one": 200, "two": 200}
    assert archive_gets(server, "shared.tgz") == 1
    assert complete(engine, "one") == complete(engine, "two")


def refusal(engine, lora_path: str) -> str:
    response = load(engine, "refused", lora_path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path" and error["type"] == "invalid_request_error", error
    assert "refused" not in roots(engine)
    return error["message"]


def test_a_checksum_mismatch_is_refused_and_leaves_nothing_in_the_cache(
    engine, server, adapter_folder, cache_dir
):
    server.archives["bad.tar.gz"] = tar_archive(adapter_files(adapter_folder))
    uri = f"{server.url}/archives/bad.tar.gz#sha256={'0' * 64}"
    before = cache_entries(cache_dir)
    message = refusal(engine, uri)
    assert message.startswith(f"lora_path {uri!r}: fetch failed: sha256 mismatch: expected {'0' * 64}, got ")
    assert cache_entries(cache_dir) == before  # no folder, no workspace left beside it


def test_a_download_that_is_no_adapter_or_is_not_there_is_refused_naming_why(engine, server, cache_dir):
    server.archives["model.tar.gz"] = tar_archive(MODEL_FILES)
    before = cache_entries(cache_dir)
    uri = f"{server.url}/archives/model.tar.gz"
    assert (
        refusal(engine, uri)
        == f"lora_path {uri!r}: fetch failed: not an adapter folder (no adapter_config.json)"
    )
    missing = f"{server.url}/archives/missing.tar.gz?sig=secret"
    message = refusal(engine, missing)
    assert "not found (HTTP 404" in message and "secret" not in message and "missing.tar.gz?…" in message
    port = free_port()
    message = refusal(engine, f"http://127.0.0.1:{port}/a.tar.gz")
    assert f"cannot connect to 127.0.0.1:{port}: connection refused" in message
    assert cache_entries(cache_dir) == before


@pytest.mark.parametrize(
    ("lora_path", "words"),
    [
        ("s3://bucket/sql", "scheme 's3' is not supported"),
        ("pvc://claim/sql", "scheme 'pvc' is not supported"),
        ("https://host/sql.zip", "an http(s) URI must name a .tar.gz, .tgz or .tar archive"),
        ("hf://no-org", "expected hf://org/name[@revision]"),
        ("file://host/sql", "not a file URI of an absolute path"),
        ("https://user:hunter2@host/sql.tar.gz", "credentials in the URL are not supported"),
    ],
)
def test_a_source_it_cannot_fetch_is_refused_naming_the_value_and_what_is_accepted(engine, lora_path, words):
    message = refusal(engine, lora_path)
    assert words in message and "accepted: a folder (/path or file:///path), hf://org/name" in message
    assert "hunter2" not in message
