"""Options of `flotilla operator run` that belong to tenancy, grouped by what they configure: the
admission webhook's server (WebhookSettings: the --webhook-* flags and --operator-namespace) and tenancy
itself (TenancySettings: metering)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class WebhookSettings:
    """The admission webhook's server (controllers/webhook_server.py) and where its state lives."""

    # Off unless a port is given: with failurePolicy Fail, a registered webhook whose operator is down
    # blocks every InferenceService write, so it is a deliberate choice.
    port: int = 0
    host: str = "127.0.0.1"  # the address the API server dials, and the certificate's SAN
    listen: str = "127.0.0.1"
    # The ValidatingWebhookConfiguration kopf writes; "" when someone else owns it (the Helm chart).
    configuration: str = "flotilla.dev"
    # A folder with tls.crt and tls.key (a mounted Secret: the chart's, cert-manager's or the platform's).
    # Unset, the operator keeps its own CA and serving certificate in the Secret flotilla-webhook-tls.
    tls_dir: str | None = None
    # The operator's namespace: the webhook's CA Secret and its quota ledger's ConfigMaps live there.
    namespace: str = "flotilla-system"


@dataclass(frozen=True)
class TenancySettings:
    """Tenancy's own: how often each Tenant is metered (controllers/metering.py)."""

    metering_interval_seconds: float = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    webhook, tenancy = WebhookSettings(), TenancySettings()
    parser.add_argument(
        "--webhook-port",
        type=int,
        default=webhook.port,
        help="serve the validating admission webhook (TLS) on this port; 0: no webhook",
    )
    parser.add_argument("--webhook-host", default=webhook.host, help="host the API server dials")
    parser.add_argument("--webhook-listen", default=webhook.listen, help="address to listen on")
    parser.add_argument(
        "--webhook-configuration",
        default=webhook.configuration,
        help="the ValidatingWebhookConfiguration the operator writes; '' when the Helm chart owns it",
    )
    parser.add_argument(
        "--webhook-tls-dir",
        help="serve the webhook with DIR/tls.crt and DIR/tls.key (a mounted Secret) instead of the operator's own CA",
    )
    parser.add_argument("--operator-namespace", default=webhook.namespace, help="for the webhook CA Secret")
    parser.add_argument(
        "--metering-interval", type=float, default=tenancy.metering_interval_seconds, help="seconds"
    )


def webhook_from_arguments(args: argparse.Namespace) -> WebhookSettings:
    return WebhookSettings(
        port=args.webhook_port,
        host=args.webhook_host,
        listen=args.webhook_listen,
        configuration=args.webhook_configuration,
        tls_dir=args.webhook_tls_dir,
        namespace=args.operator_namespace,
    )


def tenancy_from_arguments(args: argparse.Namespace) -> TenancySettings:
    if args.metering_interval <= 0:
        raise SystemExit("--metering-interval must be positive")
    return TenancySettings(metering_interval_seconds=args.metering_interval)
