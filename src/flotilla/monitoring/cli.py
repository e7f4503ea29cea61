"""`flotilla monitoring ...`: the Prometheus rules, the Grafana dashboards, a local Prometheus.

Import-light: yaml and the rules' and dashboards' data only, loaded inside the commands.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Relative to the working directory: run from the repository root.
RULES_FILE = Path("deploy") / "monitoring" / "flotilla-rules.yaml"
DASHBOARDS_DIR = Path("deploy") / "monitoring" / "dashboards"
SCRAPE_FILE = Path("deploy") / "monitoring" / "prometheus-scrape.yaml"


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    rules = subparsers.add_parser(
        "rules", help=f"regenerate {RULES_FILE} (recording rules and alerts) from flotilla.monitoring.rules"
    )
    rules.add_argument(
        "--out", type=Path, default=RULES_FILE, help=f"file to write (default: ./{RULES_FILE})"
    )
    rules.add_argument("--check", action="store_true", help="fail if the file differs instead of writing")
    rules.set_defaults(func=_rules)

    dashboards = subparsers.add_parser(
        "dashboards",
        help=f"regenerate the Grafana dashboards in {DASHBOARDS_DIR} (<uid>.json and configmaps.yaml, "
        "ConfigMaps for Grafana's sidecar) from flotilla.monitoring.dashboards",
    )
    dashboards.add_argument(
        "--out-dir", type=Path, default=DASHBOARDS_DIR, help=f"folder to write (default: ./{DASHBOARDS_DIR})"
    )
    dashboards.add_argument(
        "--check", action="store_true", help="fail if a file differs (or is left over) instead of writing"
    )
    dashboards.set_defaults(func=_dashboards)

    scrape = subparsers.add_parser(
        "scrape",
        help=f"regenerate {SCRAPE_FILE}: the scrape job and rule file for a Prometheus without the operator",
    )
    scrape.add_argument(
        "--out", type=Path, default=SCRAPE_FILE, help=f"file to write (default: ./{SCRAPE_FILE})"
    )
    scrape.add_argument("--check", action="store_true", help="fail if the file differs instead of writing")
    scrape.set_defaults(func=_scrape)

    up = subparsers.add_parser(
        "up",
        help="start a Prometheus for the local cluster (kubernetes_sd, Flotilla's rules); "
        "`flotilla cluster down` stops it",
    )
    up.add_argument("--state-dir", type=Path, help="the local cluster's state folder (default: the usual)")
    up.add_argument("--port", type=int, default=9090, help="listen on 127.0.0.1:PORT (default 9090)")
    up.add_argument(
        "--operator",
        metavar="HOST:PORT",
        action="append",
        default=[],
        help="also scrape an operator running outside the cluster (as `flotilla demo` starts it)",
    )
    up.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    import sys

    from flotilla.cluster.control_plane import ClusterConfig
    from flotilla.cluster.handle import ClusterHandle
    from flotilla.cluster.paths import default_state_dir
    from flotilla.monitoring.local import up
    from flotilla.monitoring.rules import render

    state_dir = args.state_dir or default_state_dir()
    config = ClusterConfig.load(state_dir)
    if config is None:
        print(
            f"flotilla monitoring up: no cluster in {state_dir}; run `flotilla cluster up`", file=sys.stderr
        )
        return 3
    rules = state_dir / "prometheus" / "flotilla-rules.yaml"
    rules.parent.mkdir(parents=True, exist_ok=True)
    rules.write_text(render())
    static = {"flotilla-operator": args.operator} if args.operator else None
    url = up(ClusterHandle(config, started_here=False), state_dir, port=args.port, static_targets=static,
             rule_files=[str(rules)])  # fmt: skip
    print(f"Prometheus: {url} (targets: {url}/api/v1/targets)")
    return 0


def _rules(args: argparse.Namespace) -> int:
    from flotilla.monitoring.rules import render

    return _write_or_check(args.out, render(), args.check, "rules")


def _scrape(args: argparse.Namespace) -> int:
    from flotilla.monitoring.scrape import in_cluster_config

    return _write_or_check(args.out, in_cluster_config(RULES_FILE.name), args.check, "scrape")


def _write_or_check(out: Path, text: str, check: bool, command: str) -> int:
    if check:
        if _read(out) != text:
            print(f"out of date: {out} (run `flotilla monitoring {command}`)")
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(out)
    return 0


def _dashboards(args: argparse.Namespace) -> int:
    from flotilla.monitoring.dashboards import files

    wanted = files()
    out: Path = args.out_dir
    if args.check:
        stale = [out / name for name, text in wanted.items() if _read(out / name) != text]
        # A dashboard renamed or removed leaves its old JSON behind.
        stale += sorted(p for p in out.glob("*.json") if p.name not in wanted)
        for path in stale:
            print(f"out of date: {path} (run `flotilla monitoring dashboards`)")
        return 1 if stale else 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in wanted.items():
        (out / name).write_text(text)
        print(out / name)
    return 0


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None
