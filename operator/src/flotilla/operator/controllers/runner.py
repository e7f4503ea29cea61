"""`flotilla operator run`: configure logging and metrics, then hand the process to kopf."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from flotilla.operator.config import OperatorConfig
from flotilla.operator.tenancy.settings import TenancySettings

log = logging.getLogger("flotilla.operator")


def run_operator(
    config: OperatorConfig,
    *,
    kubeconfig: Path | None,
    namespaces: Sequence[str] | None,
    metrics_host: str,
    metrics_port: int,
    liveness_port: int,
    peering: str | None,
    standalone: bool,
    priority: int | None = None,
    verbose: bool,
    tenancy: TenancySettings | None = None,
) -> int:
    import kopf

    if kubeconfig is not None:
        # kopf's own login reads $KUBECONFIG; the handlers' client gets the same file explicitly.
        os.environ["KUBECONFIG"] = str(kubeconfig)

    # Structured (JSON) logs, one object per line.
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.JSON)

    from flotilla.operator.controllers import (
        autoscaling as autoscale_handlers,  # noqa: F401 (registers the autoscaler's daemon)
    )
    from flotilla.operator.controllers import (
        services as handlers,  # registers the handlers with kopf
    )
    from flotilla.operator.controllers import (
        tenancy as tenancy_handlers,  # metering, tenant RBAC and ResourceQuota
    )

    tenancy_handlers.SETTINGS = tenancy or TenancySettings()
    if tenancy_handlers.SETTINGS.webhook_port:
        from flotilla.operator.controllers import admission as admission_handlers  # noqa: F401 (kopf needs a server for these)
    from flotilla.operator.clients.kube import Kube
    from flotilla.operator.manifests.rbac import PEERING
    from flotilla.operator.metrics import serve

    # Peering named `flotilla` when the kopf.dev CRD is installed (kopf's auto-detection); --peering NAME
    # makes it mandatory, --standalone turns it off.
    handlers.RUNTIME = handlers.Runtime(config=config, kube=Kube(kubeconfig), peering_name=peering or PEERING)
    if metrics_port:
        server = serve(metrics_host, metrics_port)
        log.info("serving /metrics and /healthz on http://%s:%d", metrics_host, server.server_address[1])

    kopf.run(
        clusterwide=not namespaces,
        namespaces=list(namespaces or ()),
        standalone=True if standalone else None,
        peering_name=peering,
        # kopf freezes every replica when peers share a priority, which would also stall a replacement
        # for a crashed operator until the dead one's peering entry expires. Start time as priority: the
        # newest replica is the active one, older ones stand by.
        priority=priority if priority is not None else int(time.time()),
        liveness_endpoint=f"http://127.0.0.1:{liveness_port}/healthz" if liveness_port else None,
    )
    return 0
