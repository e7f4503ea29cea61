"""The `flotilla` command. Each group lives beside the code it drives and registers its own subcommands.

Group modules must stay import-light (no torch, no kubernetes client at import time) so that
`flotilla cluster up` starts fast; they import heavy code inside the command functions.

The benchmarks are a distribution of their own (flotilla-bench, bench/): the product groups never import
it. Here each group in BENCHES gets its `bench` subcommand from flotilla.bench.<group>.cli when that is
installed, and otherwise a `bench` command that says where the benchmarks are.
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
    "images": ("flotilla.images.cli", "build the container images from the Dockerfile with buildah"),
    "usage": ("flotilla.operator.cmd.usage", "GPU usage and cost reports per tenant"),
    "demo": ("flotilla.demo", "the operator, a Tenant and a Ready InferenceService on the local cluster"),
    "monitoring": (
        "flotilla.monitoring.cli",
        "Prometheus rules and alerts, Grafana dashboards, a local Prometheus",
    ),
}

# group name -> (module that defines configure(bench_parser), help of `flotilla GROUP bench`)
BENCHES: dict[str, tuple[str, str]] = {
    "engine": ("flotilla.bench.engine.cli", "benchmark the engine"),
    "operator": (
        "flotilla.bench.operator.cli",
        "scale benchmark: N InferenceServices on a simulated cluster; prints figures",
    ),
    "gateway": ("flotilla.bench.gateway.cli", "benchmarks: routing policies, the gateway's own latency"),
}
BENCH_DISTRIBUTION = "flotilla-bench"
BENCH_INSTALL = "pip install -e bench"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flotilla", description="LLM inference fleets on Kubernetes.")
    groups = parser.add_subparsers(dest="group", metavar="GROUP", required=True)
    for name, (module_name, help_text) in GROUPS.items():
        group = groups.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if not _is_absent(module_name, exc):
                raise
            # Whatever follows (`flotilla engine serve ...`) gets the one line that says why.
            group.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            group.set_defaults(func=_not_installed(name, module_name))
            continue
        if hasattr(module, "configure"):  # a group that is one command with options (flotilla usage)
            module.configure(group)
            continue
        commands = group.add_subparsers(dest="command", metavar="COMMAND", required=True)
        module.add_commands(commands)
        if name in BENCHES:
            _add_bench(commands, name)
    return parser


def _add_bench(commands: argparse._SubParsersAction, group: str) -> None:
    """`flotilla GROUP bench`: flotilla-bench's subcommands, or one that says how to install them."""
    module_name, help_text = BENCHES[group]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not _is_absent(module_name, exc):
            raise
        missing = _bench_missing(group)
        # Any arguments are taken (none is an option here), so every invocation gets the one line.
        bench = commands.add_parser(
            "bench",
            help=f"{help_text} (not installed: {BENCH_DISTRIBUTION})",
            description=missing.__doc__,
            prefix_chars="\0",
            add_help=False,
        )
        bench.add_argument("args", nargs="*")
        bench.set_defaults(func=missing)
        return
    module.configure(commands.add_parser("bench", help=help_text))


def _bench_missing(group: str):
    def run(_args) -> int:
        print(run.__doc__, file=sys.stderr)
        return 2

    run.__doc__ = (
        f"flotilla {group} bench: the benchmarks are in the {BENCH_DISTRIBUTION} distribution, which is "
        f"not installed; from a checkout: {BENCH_INSTALL}"
    )
    return run


def _is_absent(module_name: str, exc: ModuleNotFoundError) -> bool:
    """Whether `exc` says `module_name` itself is not installed (it or a package above it is missing), as in
    an image that carries only some distributions. A module that is installed but imports something missing
    is a broken installation: not ours to hide."""
    return bool(exc.name) and (module_name == exc.name or module_name.startswith(f"{exc.name}."))


def _not_installed(group: str, module_name: str):
    def run(_args) -> int:
        print(
            f"flotilla {group}: not installed here ({module_name} is missing); "
            f"install the distribution that provides it",
            file=sys.stderr,
        )
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
