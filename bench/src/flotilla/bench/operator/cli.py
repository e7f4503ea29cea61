"""The flags of `flotilla operator bench` (scale.py: the scale benchmark). Import-light (argparse; the
benchmark's module imports argparse, yaml and the contract at the top): the cluster and the operator load
inside the command. The root CLI attaches `configure` under `flotilla operator` when this distribution is
installed."""

from __future__ import annotations

import argparse


def configure(bench: argparse.ArgumentParser) -> None:
    """Fills `flotilla operator bench`: one command with options."""
    from flotilla.bench.operator.scale import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from flotilla.bench.operator.scale import run

    return run(args)
