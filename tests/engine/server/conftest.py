"""Fixtures for the server tests: a tiny random model written once per session, and real uvicorn
servers on 127.0.0.1 (in a thread of this process, so tests can look at the engine's KV blocks and
inject faults)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

# The tiny-llama preset's tokenizer and chat template (a real BPE, so text round-trips) on a 2-layer,
# 64-wide decoder: each step is a few milliseconds on one CPU core.
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
MODEL_NAME = "tiny"


def write_tiny_model(folder: Path) -> Path:
    from safetensors.torch import save_file

    from flotilla.engine.model.synthetic.presets import PRESETS, build_tokenizer, random_weights

    preset = PRESETS["tiny-llama"]
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(preset)
    tok.save(str(folder / "tokenizer.json"))
    skip = {"special_tokens", "bos", "eos", "chat_template"}
    config = {k: v for k, v in preset.items() if k not in skip} | SMALL
    config.update(
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id(preset["bos"]),
        eos_token_id=tok.token_to_id(preset["eos"]),
        torch_dtype="float32",
    )
    save_file(random_weights(config, seed=0), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tok_config = {
        "bos_token": preset["bos"],
        "eos_token": preset["eos"],
        "add_bos_token": True,
        "chat_template": preset["chat_template"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Polls until predicate() holds; a generous deadline only so a broken test cannot hang."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class ServerHandle:
    def __init__(self, model: Path, engine_kwargs: dict, wait: bool = True, factory=None, **settings) -> None:
        import uvicorn

        from flotilla.engine.config import EngineConfig
        from flotilla.engine.llm_engine import LLMEngine
        from flotilla.engine.server.app import DrainingServer, ServerSettings, create_app

        kwargs = {"kv_cache_memory": 2 << 20, "show_progress": False} | engine_kwargs
        config = EngineConfig(model=str(model), **kwargs)
        self.app = create_app(
            ServerSettings(model_name=MODEL_NAME, **settings), factory or (lambda: LLMEngine(config))
        )
        self.state = self.app.state.flotilla
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        uv_config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = DrainingServer(uv_config, self.state)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        def healthy() -> bool:
            try:
                return httpx.get(f"{self.url}/health", trust_env=False).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, what="/health to answer 200")

    @property
    def llm(self):
        return self.state.engine.engine

    def free_blocks(self) -> int:
        return self.llm.kv_manager.pool.num_free_blocks

    def total_blocks(self) -> int:
        return self.llm.kv_manager.num_blocks

    def assert_no_leak(self) -> None:
        """Every KV block is free again (cached-but-unreferenced blocks count as free) and nothing runs."""
        # The client may read [DONE] a moment before the server's response task ends: poll for all.
        wait_for(
            lambda: (
                self.free_blocks() == self.total_blocks()
                and not self.llm.has_unfinished_requests()
                and self.state.in_flight == 0
            ),
            what="KV blocks back to baseline and nothing in flight",
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@pytest.fixture
def make_server(tiny_model):
    """Starts servers with custom settings; stops them at the end of the test."""
    started: list[ServerHandle] = []

    def make(engine_kwargs: dict | None = None, **settings) -> ServerHandle:
        handle = ServerHandle(tiny_model, engine_kwargs or {}, **settings)
        started.append(handle)
        return handle

    yield make
    for handle in started:
        handle.stop()


@pytest.fixture(scope="session")
def shared_server(tiny_model):
    handle = ServerHandle(tiny_model, {"max_num_seqs": 32})
    yield handle
    handle.stop()


@pytest.fixture
def server(shared_server):
    """The shared server; every test that uses it must leave no KV block behind."""
    yield shared_server
    shared_server.assert_no_leak()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, trust_env=False, timeout=60) as client:
        yield client


@pytest.fixture(name="wait_for")
def wait_for_fixture():
    return wait_for
