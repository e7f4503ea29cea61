"""The engine benchmarks' tests use the engine tests' models (tests/engine/conftest.py) and the server tests'
shared server (tests/engine/server/conftest.py): the same fixtures, imported."""

from ...engine.conftest import hf_models, tiny_preset
from ...engine.server.conftest import server, shared_server, tiny_model

__all__ = ["hf_models", "server", "shared_server", "tiny_model", "tiny_preset"]
