"""Starts the gateway under uvicorn: the one place that opens its listener."""

from __future__ import annotations

import socket

import uvicorn

from flotilla.gateway.app import Gateway, build_app


def run_gateway(gateway: Gateway, host: str, port: int, sock: socket.socket | None = None) -> None:
    # Keep-alive longer than a client's idle pool, so a pooled connection is not closed under a new request.
    config = uvicorn.Config(build_app(gateway), host=host, port=port, log_level="warning",
                            timeout_keep_alive=75, timeout_graceful_shutdown=30)  # fmt: skip
    server = uvicorn.Server(config)
    server.run(sockets=[sock] if sock is not None else None)
