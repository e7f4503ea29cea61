"""`flotilla operator ...`: generate manifests and run the operator.

Import-light on purpose: kopf and the kubernetes client are imported inside the commands.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Defaults are relative to the working directory: run these from the repository root.
CRD_DIR = Path("crds")
RBAC_FILE = Path("deploy") / "operator-rbac.yaml"
CHART_DIR = Path("charts") / "flotilla"


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    crds = subparsers.add_parser("crds", help="regenerate crds/*.yaml from the API types")
    crds.add_argument("--out", type=Path, default=CRD_DIR, help="directory to write (default: ./crds)")
    crds.add_argument("--check", action="store_true", help="fail if the files differ instead of writing")
    crds.set_defaults(func=_crds)

    rbac = subparsers.add_parser("rbac", help="regenerate deploy/operator-rbac.yaml (least-privilege RBAC)")
    rbac.add_argument("--out", type=Path, default=RBAC_FILE)
    rbac.add_argument("--namespace", default="flotilla-system")
    rbac.add_argument("--check", action="store_true", help="fail if the file differs instead of writing")
    rbac.set_defaults(func=_rbac)

    chart = subparsers.add_parser(
        "chart", help="regenerate charts/flotilla/files/ (CRDs, RBAC rules, monitoring) from the generators"
    )
    chart.add_argument(
        "--out", type=Path, default=CHART_DIR, help="the chart folder (default: ./charts/flotilla)"
    )
    chart.add_argument("--check", action="store_true", help="fail if the files differ instead of writing")
    chart.set_defaults(func=_chart)

    release = subparsers.add_parser(
        "release-finalizers",
        help="stop the operator and remove its finalizers (the chart's pre-delete hook, before helm uninstall)",
    )
    _add_module_arguments(release, "release_finalizers")
    release.set_defaults(func=lambda args: _run_module(args, "release_finalizers"))

    smoke = subparsers.add_parser(
        "smoke-test",
        help="apply a tiny InferenceService and ask it for one completion (the chart's helm test)",
    )
    _add_module_arguments(smoke, "smoke_test")
    smoke.set_defaults(func=lambda args: _run_module(args, "smoke_test"))

    run = subparsers.add_parser("run", help="run the operator (kopf) against the current kubeconfig")
    run.add_argument("--kubeconfig", type=Path, help="default: $KUBECONFIG or in-cluster")
    run.add_argument("--namespace", action="append", help="watch only these namespaces (default: all)")
    run.add_argument("--metrics-port", type=int, default=8080, help="/metrics and /healthz (0: off)")
    run.add_argument("--metrics-host", default="127.0.0.1")
    run.add_argument("--liveness-port", type=int, default=0, help="kopf's own liveness endpoint (0: off)")
    run.add_argument("--default-image", help="engine image when a spec names none")
    run.add_argument("--hf-cache-dir", help="resolve hf://org/name to DIR/org/name on the node")
    run.add_argument(
        "--host-path-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a node folder whose paths tenants may mount (repeatable): file:// model uris and "
        "spec.engine.lora.adapterDir must be DIR or under it (default: none, so every one is refused)",
    )
    run.add_argument(
        "--prometheus-url", help="autoscaler reads engine metrics from this Prometheus (default: scrape pods)"
    )
    run.add_argument(
        "--engine-token-file",
        type=Path,
        help="a file with the installation's master token (the gateway's): each namespace with engines gets "
        "the Secret of its derived internal token, and engines get it in their environment (default: none)",
    )
    run.add_argument(
        "--no-model-path-check",
        action="store_true",
        help="do not check file:// model paths on this machine (a real cluster's nodes have their own disks)",
    )
    run.add_argument(
        "--no-inference-pools",
        action="store_true",
        help="keep no InferencePool per InferenceService (for a cluster without the Gateway API Inference "
        "Extension's CRD; docs/inference-extension.md)",
    )
    peering = run.add_mutually_exclusive_group()
    peering.add_argument("--peering", help="kopf peering object name (needs the kopf.dev peering CRDs)")
    peering.add_argument("--standalone", action="store_true", help="no peering (the default when no CRD)")
    run.add_argument(
        "--priority", type=int, help="kopf peering priority (default: start time, newest active)"
    )
    run.add_argument(
        "--drain-seconds",
        type=float,
        default=0.0,
        help="seconds to keep serving the webhook after SIGTERM before stopping (a pod's rolling update)",
    )
    run.add_argument("--verbose", action="store_true")
    _add_tenancy_arguments(run)
    run.set_defaults(func=_run)


def _add_tenancy_arguments(parser: argparse.ArgumentParser) -> None:
    from flotilla.operator.tenancy.settings import add_arguments  # import-light: argparse, dataclasses

    add_arguments(parser)


def _add_module_arguments(parser: argparse.ArgumentParser, module: str) -> None:
    import importlib  # these command modules import only argparse and the API names at the top

    importlib.import_module(f"flotilla.operator.cmd.{module}").add_arguments(parser)


def _run_module(args: argparse.Namespace, module: str) -> int:
    import importlib

    return importlib.import_module(f"flotilla.operator.cmd.{module}").run(args)


def _crds(args: argparse.Namespace) -> int:
    from flotilla.operator.manifests.crds import crd_files, write_crds

    if args.check:
        return _check({args.out / name: text for name, text in crd_files().items()})
    for path in write_crds(args.out):
        print(path)
    return 0


def _chart(args: argparse.Namespace) -> int:
    from flotilla.operator.controllers.webhook_reviews import webhook_definitions
    from flotilla.operator.manifests.chart import files, write

    if args.check:
        return _check(
            {args.out / "files" / name: text for name, text in files(webhook_definitions()).items()}
        )
    for path in write(webhook_definitions(), args.out):
        print(path)
    return 0


def _rbac(args: argparse.Namespace) -> int:
    from flotilla.operator.manifests.rbac import render

    text = render(args.namespace)
    if args.check:
        return _check({args.out: text})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(args.out)
    return 0


def _check(expected: dict[Path, str]) -> int:
    stale = [str(p) for p, text in expected.items() if not p.exists() or p.read_text() != text]
    for path in stale:
        print(f"out of date: {path} (run `flotilla operator crds` / `rbac` / `chart`)")
    return 1 if stale else 0


def read_engine_token(path: Path | None) -> str | None:
    """The master token in --engine-token-file (surrounding whitespace dropped: a mounted Secret's file or
    an `echo`ed one); None without the flag. Read once: a new master takes an operator restart."""
    if path is None:
        return None
    try:
        master = path.read_text().strip()
    except OSError as exc:
        raise SystemExit(f"--engine-token-file {path}: {exc.strerror or exc}") from exc
    if not master:
        raise SystemExit(f"--engine-token-file {path}: the file is empty")
    return master


def _run(args: argparse.Namespace) -> int:
    from flotilla.operator.config import OperatorConfig
    from flotilla.operator.controllers.runner import run_operator
    from flotilla.operator.tenancy.settings import tenancy_from_arguments, webhook_from_arguments

    defaults = OperatorConfig()
    try:
        config = OperatorConfig(
            default_image=args.default_image or defaults.default_image,
            hf_cache_dir=args.hf_cache_dir,
            host_path_roots=tuple(args.host_path_root),
            prometheus_url=args.prometheus_url,
            check_local_model_paths=not args.no_model_path_check,
            engine_token_master=read_engine_token(args.engine_token_file),
            inference_pools=not args.no_inference_pools,
            # Flotilla's gateway runs beside the operator (the chart's namespace).
            gateway_namespace=args.operator_namespace,
        )
    except ValueError as exc:  # a folder flag that is not an absolute path: said in one line, at start
        raise SystemExit(f"flotilla operator run: {exc}") from None
    return run_operator(
        config,
        kubeconfig=args.kubeconfig,
        namespaces=args.namespace,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        liveness_port=args.liveness_port,
        peering=args.peering,
        standalone=args.standalone,
        priority=args.priority,
        verbose=args.verbose,
        webhook=webhook_from_arguments(args),
        tenancy=tenancy_from_arguments(args),
        drain_seconds=args.drain_seconds,
    )
