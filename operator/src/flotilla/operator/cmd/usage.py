"""`flotilla usage`: GPU-seconds, cost and tokens per tenant, read from Tenant.status.

Import-light: the kubernetes client is imported when the command runs. A tenant member, who may `get`
only their own Tenant, runs it with --tenant NAME; without --tenant it lists every Tenant.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, date, datetime
from pathlib import Path
from typing import cast


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenant", action="append", help="only this tenant (repeatable; default: all)")
    parser.add_argument("--since", type=date.fromisoformat, help="first UTC day, YYYY-MM-DD (inclusive)")
    parser.add_argument("--until", type=date.fromisoformat, help="last UTC day, YYYY-MM-DD (inclusive)")
    parser.add_argument("--format", choices=["table", "csv", "json"], default="table")
    parser.add_argument("--kubeconfig", type=Path, help="default: $KUBECONFIG or ~/.kube/config")
    parser.set_defaults(func=run)


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """For callers that expect the usual group interface: `flotilla usage report ...`."""
    configure(subparsers.add_parser("report", help="print the usage report"))


def run(args: argparse.Namespace) -> int:
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    from flotilla.operator.api.v1alpha1 import GROUP, TENANT, VERSION, TenantSpec, TenantStatus
    from flotilla.operator.tenancy.usage import WindowError, check_window, render, report

    try:
        check_window(args.since, args.until, datetime.now(UTC).date())
    except WindowError as exc:
        print(f"flotilla usage: {exc}", file=sys.stderr)
        return 2
    api = client.CustomObjectsApi(
        config.new_client_from_config(str(args.kubeconfig) if args.kubeconfig else None)
    )
    try:
        if args.tenant:
            tenants = [
                cast(dict, api.get_cluster_custom_object(GROUP, VERSION, TENANT.plural, name))
                for name in args.tenant
            ]
        else:
            tenants = api.list_cluster_custom_object(GROUP, VERSION, TENANT.plural)["items"]
    except ApiException as exc:
        print(f"flotilla usage: reading Tenants failed: {exc.status} {exc.reason}", file=sys.stderr)
        return 1
    reports = [
        report(
            t["metadata"]["name"],
            TenantSpec.model_validate(t.get("spec") or {}),
            TenantStatus.model_validate(t.get("status") or {}),
            args.since,
            args.until,
        )
        for t in sorted(tenants, key=lambda t: t["metadata"]["name"])
    ]
    window = {"since": args.since and args.since.isoformat(), "until": args.until and args.until.isoformat()}
    sys.stdout.write(render(reports, args.format, window))
    return 0
