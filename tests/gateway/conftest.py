"""The gateway's relay tests put real engine servers behind it: the engine server tests' fixtures, imported."""

from ..engine.server.conftest import make_server, tiny_model

__all__ = ["make_server", "tiny_model"]
