"""Options of `flotilla operator run` that belong to tenancy: the admission webhook and metering."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class TenancySettings:
    # The admission webhook is off unless a port is given: with failurePolicy Fail, a registered webhook
    # whose operator is down blocks every InferenceService write, so it is a deliberate choice.
    webhook_port: int = 0
    webhook_host: str = "127.0.0.1"  # the address the API server dials, and the certificate's SAN
    webhook_listen: str = "127.0.0.1"
    # The ValidatingWebhookConfiguration kopf writes; "" when someone else owns it (the Helm chart).
    webhook_configuration: str = "flotilla.dev"
    # A folder with tls.crt and tls.key (a mounted Secret: the chart's, cert-manager's or the platform's).
    # Unset, the operator keeps its own CA and serving certificate in the Secret flotilla-webhook-tls.
    webhook_tls_dir: str | None = None
    namespace: str = "flotilla-system"  # where the webhook's CA Secret lives
    metering_interval_seconds: float = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TenancySettings()
    parser.add_argument(
        "--webhook-port",
        type=int,
        default=defaults.webhook_port,
        help="serve the validating admission webhook (TLS) on this port; 0: no webhook",
    )
    parser.add_argument("--webhook-host", default=defaults.webhook_host, help="host the API server dials")
    parser.add_argument("--webhook-listen", default=defaults.webhook_listen, help="address to listen on")
    parser.add_argument(
        "--webhook-configuration",
        default=defaults.webhook_configuration,
        help="the ValidatingWebhookConfiguration the operator writes; '' when the Helm chart owns it",
    )
    parser.add_argument(
        "--webhook-tls-dir",
        help="serve the webhook with DIR/tls.crt and DIR/tls.key (a mounted Secret) instead of the operator's own CA",
    )
    parser.add_argument("--operator-namespace", default=defaults.namespace, help="for the webhook CA Secret")
    parser.add_argument(
        "--metering-interval", type=float, default=defaults.metering_interval_seconds, help="seconds"
    )


def from_arguments(args: argparse.Namespace) -> TenancySettings:
    if args.metering_interval <= 0:
        raise SystemExit("--metering-interval must be positive")
    return TenancySettings(
        webhook_port=args.webhook_port,
        webhook_host=args.webhook_host,
        webhook_listen=args.webhook_listen,
        webhook_configuration=args.webhook_configuration,
        webhook_tls_dir=args.webhook_tls_dir,
        namespace=args.operator_namespace,
        metering_interval_seconds=args.metering_interval,
    )
