"""`flotilla operator run`: configure logging and metrics, then hand the process to kopf."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from flotilla.operator.config import OperatorConfig
from flotilla.operator.tenancy.settings import TenancySettings, WebhookSettings

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
    webhook: WebhookSettings | None = None,
    tenancy: TenancySettings | None = None,
    drain_seconds: float = 0.0,
) -> int:
    import kopf

    from flotilla.operator.clients.kube import Kube
    from flotilla.operator.controllers import failpoints
    from flotilla.operator.controllers.state import Runtime, new_memo
    from flotilla.operator.manifests.rbac import PEERING

    failpoint = failpoints.armed()  # an unknown name refuses the start
    if failpoint:
        log.warning(
            "armed with failpoint %s: the operator dies when %s", failpoint, failpoints.POINTS[failpoint]
        )
    if kubeconfig is not None:
        # kopf's own login reads $KUBECONFIG; the handlers' client gets the same file explicitly.
        os.environ["KUBECONFIG"] = str(kubeconfig)
    kube = Kube(kubeconfig)
    webhook = webhook or WebhookSettings()
    tenancy = tenancy or TenancySettings()
    if webhook.port:
        # kopf needs a server for the validating handlers; importing them registers both.
        from flotilla.operator.controllers import webhook_reviews, webhook_server  # noqa: F401

        webhook_server.require_namespace(kube, webhook.namespace)  # before kopf: one line, not a retry loop

    # Structured (JSON) logs, one object per line.
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.JSON)

    # Importing the handler modules registers them with kopf.
    from flotilla.operator.controllers import (  # noqa: F401
        autoscaling,  # the autoscaler's daemon
        child_events,  # drift correction and status refresh on owned children
        cluster_events,  # nodes, namespaces and Tenants: retry what they may unblock
        indexes,  # the in-memory indexes every handler reads
        lifecycle,  # kopf's settings and login
        lora_adapters,  # LoRAAdapters loaded into their base service's replicas
        metering,  # metering, tenant RBAC and ResourceQuota
        picker_endpoints,  # the picker's Service and EndpointSlice in each namespace with services
        service_events,  # the InferenceService reconcile
    )
    from flotilla.operator.metrics import serve

    if not standalone:
        try:
            kube.ensure_peering(peering or PEERING)
        except Exception as exc:  # kopf retries its own peering; one warning says why it may be standalone
            log.warning("could not create ClusterKopfPeering %s: %s", peering or PEERING, exc)
    # Peering named `flotilla` when the kopf.dev CRD is installed (kopf's auto-detection); --peering NAME
    # makes it mandatory, --standalone turns it off.
    runtime = Runtime(
        config=config, kube=kube, webhook=webhook, tenancy=tenancy, peering_name=peering or PEERING
    )
    if metrics_port:
        server = serve(metrics_host, metrics_port)
        log.info("serving /metrics and /healthz on http://%s:%d", metrics_host, server.server_address[1])

    run = functools.partial(
        kopf.run,
        clusterwide=not namespaces,
        namespaces=list(namespaces or ()),
        standalone=True if standalone else None,
        peering_name=peering,
        # kopf freezes every replica when peers share a priority, which would also stall a replacement
        # for a crashed operator until the dead one's peering entry expires. Start time as priority: the
        # newest replica is the active one, older ones stand by.
        priority=priority if priority is not None else int(time.time()),
        liveness_endpoint=f"http://127.0.0.1:{liveness_port}/healthz" if liveness_port else None,
        memo=new_memo(runtime),  # every handler's shared state (state.py)
    )
    if drain_seconds <= 0:
        run()  # kopf handles SIGTERM itself: it stops at once
    else:
        _run_draining(run, drain_seconds)
    return 0


def _run_draining(run, delay: float) -> None:
    """kopf on a worker thread; SIGTERM starts a drain: the webhook keeps answering for `delay` seconds
    while whatever routes to this pod (endpoints, the local cluster's node ports) drops it, then kopf
    stops. Stopping at once would cut admission reviews already on their way here, which the API server
    reports as failures (failurePolicy Fail) during every rolling update of the operator."""
    from flotilla.operator.metrics import HEALTH

    stop = threading.Event()
    draining = threading.Event()

    def on_signal(signum, _frame) -> None:
        if draining.is_set():
            stop.set()  # a second signal: stop now
            return
        draining.set()
        log.info("signal %d: serving %.0fs more while this pod is taken out of rotation", signum, delay)
        HEALTH.set(False)
        threading.Timer(delay, stop.set).start()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    worker = threading.Thread(target=run, kwargs={"stop_flag": stop}, name="kopf")
    worker.start()
    while worker.is_alive():
        worker.join(timeout=0.5)  # the main thread stays free to take signals
