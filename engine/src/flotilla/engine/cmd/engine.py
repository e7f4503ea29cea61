"""`flotilla engine ...`. Import-light: torch and the engine load inside the command functions.

`flotilla engine bench ...` is the flotilla-bench distribution's (flotilla.bench.engine.cli); the root CLI
attaches it."""

from __future__ import annotations

import argparse


def add_commands(subparsers) -> None:
    from flotilla.engine.cmd.serve import add_serve_args

    serve = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve one model: /v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics, /tokenize, /detokenize. SIGTERM drains: in-flight requests finish, new ones are refused.",
    )
    add_serve_args(serve)
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from flotilla.engine.cmd.serve import run_serve

    return run_serve(args)
