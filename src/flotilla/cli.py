"""The `flotilla` command. Each group lives beside the code it drives and registers its own subcommands.

Group modules must stay import-light (no torch, no kubernetes client at import time) so that
`flotilla cluster up` starts fast; they import heavy code inside the command functions.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# group name -> (module that defines add_commands(subparsers), help)
GROUPS: dict[str, tuple[str, str]] = {
    "engine": ("flotilla.engine.cmd.engine", "run and benchmark the inference engine"),
    "model": ("flotilla.engine.cmd.model", "create and inspect model folders"),
    "operator": ("flotilla.operator.cmd.cli", "run the operator and generate its manifests"),
    "gateway": (
        "flotilla.gateway.cmd",
        "the OpenAI front door: tenant keys, rate limits, routing, scale from zero",
    ),
    "cluster": ("flotilla.cluster.cli", "the local Kubernetes cluster: build, up, down, status"),
    "usage": ("flotilla.operator.cmd.usage", "GPU usage and cost reports per tenant"),
    "demo": ("flotilla.demo", "the operator, a Tenant and a Ready InferenceService on the local cluster"),
    "monitoring": (
        "flotilla.monitoring.cli",
        "Prometheus rules and alerts, Grafana dashboards, a local Prometheus",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flotilla", description="LLM inference fleets on Kubernetes.")
    groups = parser.add_subparsers(dest="group", metavar="GROUP", required=True)
    for name, (module_name, help_text) in GROUPS.items():
        group = groups.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            group.set_defaults(func=_not_built(name))
            continue
        if hasattr(module, "configure"):  # a group that is one command with options (flotilla usage)
            module.configure(group)
            continue
        module.add_commands(group.add_subparsers(dest="command", metavar="COMMAND", required=True))
    return parser


def _not_built(group: str):
    def run(_args) -> int:
        print(f"flotilla {group}: this command group is not implemented yet", file=sys.stderr)
        return 2

    return run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.parse_args([args.group, "--help"])
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
