"""Runs the server under uvicorn until it has drained: the one place that starts a listener, so the
command line above it imports no web framework."""

from __future__ import annotations

from collections.abc import Callable

import uvicorn

from flotilla.engine.server.app import DrainingServer, create_app
from flotilla.engine.server.state import ServerSettings

__all__ = ["ServerSettings", "run_server"]


def run_server(
    settings: ServerSettings,
    build_engine: Callable,
    *,
    host: str,
    port: int,
    log_level: str,
    access_log: bool,
    drain_timeout: float,
    shutdown_delay: float,
) -> bool:
    """Serves until SIGTERM has drained (or the model failed to load); True when loading failed."""
    failed: list[BaseException] = []
    server: DrainingServer | None = None

    def on_load_failure(exc: BaseException) -> None:
        failed.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, build_engine, on_load_failure)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=drain_timeout,
        timeout_keep_alive=5,
    )
    server = DrainingServer(config, app.state.flotilla, shutdown_delay)
    server.run()
    return bool(failed)
