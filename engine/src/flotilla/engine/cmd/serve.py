"""`flotilla engine serve`: flags, start-up checks and the uvicorn server with graceful drain."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

from flotilla.contract import (
    ENGINE_PORT,
    ENV_API_KEY,
    ENV_GATEWAY_TOKEN_SHA256,
    ENV_INTERNAL_TOKEN,
    ENV_TENANT,
    FLAG_DRAIN_TIMEOUT,
    FLAG_HOST,
    FLAG_PORT,
    FLAG_SERVED_MODEL_NAME,
    FLAG_SHUTDOWN_DELAY,
    HEADER_GATEWAY_TOKEN,
    HEADER_INTERNAL_TOKEN,
    HEADER_TENANT,
)
from flotilla.engine.engine_args import add_engine_args, engine_config_from_args, parse_bytes


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(FLAG_HOST, default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument(FLAG_PORT, type=int, default=ENGINE_PORT)
    parser.add_argument(
        FLAG_SERVED_MODEL_NAME, help="the model name clients use (default: the folder's name)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(ENV_API_KEY),
        help="require 'Authorization: Bearer KEY' on the API (default: $FLOTILLA_API_KEY; unset: no key)",
    )
    parser.add_argument(
        "--internal-token",
        default=os.environ.get(ENV_INTERNAL_TOKEN),
        help=f"the operator's credential: loading and unloading LoRA adapters needs it in "
        f"{HEADER_INTERNAL_TOKEN} (default: ${ENV_INTERNAL_TOKEN}; unset: --api-key alone guards them)",
    )
    parser.add_argument(
        "--gateway-token-sha256",
        default=os.environ.get(ENV_GATEWAY_TOKEN_SHA256),
        help=f"the SHA-256 (hex) of the gateway's credential: a request may name its tenant in "
        f"{HEADER_TENANT} only with that credential in {HEADER_GATEWAY_TOKEN} (default: "
        f"${ENV_GATEWAY_TOKEN_SHA256}; unset: no request may name a tenant, and every request is served "
        f"for ${ENV_TENANT})",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests that may wait for a batch slot; more get 429 (0 or less: unbounded; default 256)",
    )
    parser.add_argument("--max-body-size", type=parse_bytes, default="8MiB", help="largest request body")
    parser.add_argument(
        FLAG_DRAIN_TIMEOUT,
        type=float,
        default=25.0,
        help="on SIGTERM, seconds to let in-flight requests finish (keep it under the pod's grace period)",
    )
    parser.add_argument(
        FLAG_SHUTDOWN_DELAY,
        type=float,
        default=5.0,
        help="on SIGTERM, keep serving new requests this long while /health is 503, so endpoints stop "
        "routing here before the listener closes (default 5; 0: close at once)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_args(parser)


def serving_threads() -> int:
    """A server's default torch CPU threads: all cores but one, which the HTTP loop needs to stream tokens
    (measured on 2 cores, tiny-llama, 16 streams: 209 output tok/s with 1 thread, 167 with 2)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def run_serve(args: argparse.Namespace) -> int:
    from flotilla.engine.llm_engine import LLMEngine  # no torch until the engine is built
    from flotilla.engine.model.config import ModelLoadError
    from flotilla.engine.server.run import ServerSettings, run_server
    from flotilla.engine.worker.model_files import ModelFiles

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:  # fail fast, before listening, on flags or a folder that cannot work
        for flag, value in (
            (FLAG_SHUTDOWN_DELAY, args.shutdown_delay),
            (FLAG_DRAIN_TIMEOUT, args.drain_timeout),
        ):
            if value < 0:
                raise ValueError(f"{flag} must be 0 seconds or more, got {value}")
        config = engine_config_from_args(args)
        if config.cpu_threads == 0:
            config = dataclasses.replace(config, cpu_threads=serving_threads())
        # config.json, the tokenizer and a draft model's config, read (and checked) once: the engine gets
        # them, and loads only the weights after the server listens (/health says 503 meanwhile).
        files = ModelFiles.load(config)
    except (ModelLoadError, ValueError) as exc:
        print(f"flotilla engine serve: {exc}", file=sys.stderr)
        return 2

    def build_engine() -> LLMEngine:
        return LLMEngine(config, files)

    settings = ServerSettings(
        model_name=args.served_model_name or Path(args.model).resolve().name,
        api_key=args.api_key or None,
        internal_token=args.internal_token or None,
        gateway_token_sha256=(args.gateway_token_sha256 or "").lower() or None,
        max_queue=args.max_queue if args.max_queue > 0 else None,
        max_body_bytes=args.max_body_size,
    )
    load_failed = run_server(
        settings,
        build_engine,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        drain_timeout=args.drain_timeout,
        shutdown_delay=args.shutdown_delay,
    )
    return 1 if load_failed else 0
