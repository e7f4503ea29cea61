"""The admission webhook's server, loaded only with `flotilla operator run --webhook-port` (kopf refuses
to start with validating handlers and no webhook server).

TLS from the CA in the Secret `flotilla-webhook-tls` in the operator's namespace (webhook_tls.py), on an
explicit port; kopf writes the ValidatingWebhookConfiguration (failurePolicy Fail) with that CA as
caBundle. `require_namespace` runs before kopf starts: without the namespace, kopf would retry the
start-up handler forever (a traceback a minute, nothing reconciled) instead of saying what is missing.
"""

from __future__ import annotations

import datetime as dt
import logging
import tempfile
from pathlib import Path

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from flotilla.operator.clients.kube import Kube
from flotilla.operator.controllers import webhook_tls
from flotilla.operator.controllers.state import Runtime
from flotilla.operator.manifests.rbac import MANIFEST_FILE, NAMESPACE
from flotilla.operator.metrics import API_CALLS
from flotilla.operator.tenancy.settings import WebhookSettings

log = logging.getLogger("flotilla.operator.tenancy.admission")


def require_namespace(kube: Kube, namespace: str) -> None:
    """Exit with one line when the namespace for the webhook's Secret does not exist. Any other failure
    to tell (no access, the API not up yet) is left to the start-up handler, which retries."""
    API_CALLS.labels(verb="get", resource="namespaces").inc()
    try:
        kube.core.read_namespace(namespace)
    except ApiException as exc:
        if exc.status == 404:
            raise SystemExit(missing_namespace_message(namespace)) from None
        log.warning("could not check that namespace %s exists: %s", namespace, exc)
    except Exception as exc:
        log.warning("could not check that namespace %s exists: %s", namespace, exc)


def missing_namespace_message(namespace: str) -> str:
    create = f"kubectl apply -f {MANIFEST_FILE}"
    if namespace != NAMESPACE:  # the checked-in manifest is rendered for the default namespace
        create = f"flotilla operator rbac --namespace {namespace} && {create}"
    return (
        f"flotilla operator: namespace {namespace} does not exist, and the admission webhook (--webhook-port) "
        f"keeps its TLS Secret there; create it with `{create}` (the operator's namespace, ServiceAccount "
        "and RBAC)"
    )


@kopf.on.startup()
def webhook_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    rt: Runtime = memo.runtime
    webhook = rt.webhook
    if webhook.tls_dir:
        cafile, certfile, pkeyfile = webhook_tls.mounted_files(Path(webhook.tls_dir))
    else:
        material = _webhook_material(rt.kube, webhook)
        cafile, certfile, pkeyfile = webhook_tls.write_files(
            material, Path(tempfile.mkdtemp(prefix="flotilla-webhook-"))
        )
    settings.admission.server = kopf.WebhookServer(
        addr=webhook.listen,
        port=webhook.port,
        host=webhook.host,
        cafile=cafile,
        certfile=certfile,
        pkeyfile=pkeyfile,
    )
    settings.admission.managed = webhook.configuration or None
    log.info("admission webhook on https://%s:%d", webhook.host, webhook.port)


def _webhook_material(kube: Kube, webhook: WebhookSettings) -> webhook_tls.Material:
    """The Secret's CA and serving certificate, created or renewed if needed. Replicas race safely:
    create and replace are conditional, and the loser reads the winner's."""
    core, namespace = kube.core, webhook.namespace
    for _attempt in range(5):
        try:
            secret = core.read_namespaced_secret(webhook_tls.SECRET_NAME, namespace)
            existing = webhook_tls.Material.from_secret_data(secret.data)
        except ApiException as exc:
            if exc.status != 404:
                raise
            secret, existing = None, None
        material = webhook_tls.ensure(existing, [webhook.host], dt.datetime.now(dt.UTC))
        if material is existing:
            return material
        body = client.V1Secret(
            metadata=client.V1ObjectMeta(
                name=webhook_tls.SECRET_NAME,
                namespace=namespace,
                resource_version=secret.metadata.resource_version if secret else None,
            ),
            type="Opaque",
            data=material.to_secret_data(),
        )
        try:
            if secret is None:
                core.create_namespaced_secret(namespace, body)
            else:
                core.replace_namespaced_secret(webhook_tls.SECRET_NAME, namespace, body)
            return material
        except ApiException as exc:
            if exc.status != 409:  # another replica wrote it first: read theirs
                raise
    raise RuntimeError(f"could not settle Secret {namespace}/{webhook_tls.SECRET_NAME}")
