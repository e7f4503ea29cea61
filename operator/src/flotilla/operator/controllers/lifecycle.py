"""The operator's start and stop: kopf's settings, its login, and the health flag."""

from __future__ import annotations

import logging

import kopf

from flotilla.operator.api.v1alpha1 import GROUP
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.metrics import HEALTH


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    runtime: Runtime = memo.runtime
    # Handler progress lives in annotations: status belongs to the API (and its schema prunes kopf's).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Events only for what we post ourselves and real warnings, not one per handler run.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 16
    settings.watching.server_timeout = 300
    settings.peering.name = runtime.peering_name or settings.peering.name
    HEALTH.set(True)


@kopf.on.login()
def login(memo: kopf.Memo, **_) -> kopf.ConnectionInfo:
    """kopf talks to the API with the same credentials as our client (one kubeconfig, loaded once)."""
    cfg = memo.runtime.kube.configuration
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme=scheme or ("Bearer" if token else None),
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


@kopf.on.cleanup()
def stopping(memo: kopf.Memo, **_) -> None:
    HEALTH.set(False)
    memo.reviews.shutdown(wait=False)
