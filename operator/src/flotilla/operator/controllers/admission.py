"""The admission webhook's kopf layer, loaded only with `flotilla operator run --webhook-port`
(kopf refuses to start with validating handlers and no webhook server).

- TLS from the CA in the Secret `flotilla-webhook-tls` (webhook_tls.py), on an explicit port; kopf
  writes the ValidatingWebhookConfiguration (failurePolicy Fail) with that CA as caBundle.
- InferenceServices (create, update, and the scale subresource) are charged against their Tenant's
  quota by admission.review; each check and its reservation happen under one lock with the Ledger, so
  concurrent reviews cannot both pass into over-quota.
- Tenants are refused when they claim a namespace another Tenant claims.
"""

from __future__ import annotations

import datetime as dt
import logging
import tempfile
import threading
import time
from pathlib import Path

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from flotilla.operator.api.v1alpha1 import GROUP, TENANT, VERSION, TenantSpec
from flotilla.operator.controllers import tenancy as tenancy_handlers
from flotilla.operator.controllers import webhook_tls
from flotilla.operator.controllers.services import ISVC, labels_by_namespace, runtime, tenant_specs
from flotilla.operator.desired.validation import parse_spec
from flotilla.operator.metrics import API_CALLS
from flotilla.operator.tenancy import admission
from flotilla.operator.tenancy.rules import tenant_of, tenant_problems

log = logging.getLogger("flotilla.operator.tenancy.admission")

LEDGER = admission.Ledger()
# Tenants admitted moments ago that the index may not show yet: name -> (spec, expiry).
_recent_tenants: dict[str, tuple[TenantSpec, float]] = {}
_tenants_lock = threading.RLock()  # admit_tenant holds it across _known_tenants
RECENT_TENANT_SECONDS = 30.0


def _known_tenants(kwargs: dict) -> dict[str, TenantSpec]:
    """The tenants index, plus Tenants this webhook admitted moments ago that the watch has not delivered
    yet (newest first): `kubectl apply` of a Tenant and its first service together must not race."""
    with _tenants_lock:
        now = time.monotonic()
        for name, (_, expiry) in list(_recent_tenants.items()):
            if expiry <= now:
                del _recent_tenants[name]
        recent = {name: spec for name, (spec, _) in _recent_tenants.items()}
    return {**tenant_specs(kwargs["tenants"]), **recent}


# ---------------------------------------------------------------------------------------------------
# Webhook server


@kopf.on.startup()
def webhook_startup(settings: kopf.OperatorSettings, **_) -> None:
    material = _webhook_material()
    cafile, certfile, pkeyfile = webhook_tls.write_files(
        material, Path(tempfile.mkdtemp(prefix="flotilla-webhook-"))
    )
    settings.admission.server = kopf.WebhookServer(
        addr=tenancy_handlers.SETTINGS.webhook_listen,
        port=tenancy_handlers.SETTINGS.webhook_port,
        host=tenancy_handlers.SETTINGS.webhook_host,
        cafile=cafile,
        certfile=certfile,
        pkeyfile=pkeyfile,
    )
    settings.admission.managed = tenancy_handlers.SETTINGS.webhook_configuration
    log.info(
        "admission webhook on https://%s:%d",
        tenancy_handlers.SETTINGS.webhook_host,
        tenancy_handlers.SETTINGS.webhook_port,
    )


def _webhook_material() -> webhook_tls.Material:
    """The Secret's CA and serving certificate, created or renewed if needed. Replicas race safely:
    create and replace are conditional, and the loser reads the winner's."""
    core = runtime().kube.core
    for _attempt in range(5):
        try:
            secret = core.read_namespaced_secret(webhook_tls.SECRET_NAME, tenancy_handlers.SETTINGS.namespace)
            existing = webhook_tls.Material.from_secret_data(secret.data)
        except ApiException as exc:
            if exc.status != 404:
                raise
            secret, existing = None, None
        material = webhook_tls.ensure(
            existing, [tenancy_handlers.SETTINGS.webhook_host], dt.datetime.now(dt.UTC)
        )
        if material is existing:
            return material
        body = client.V1Secret(
            metadata=client.V1ObjectMeta(
                name=webhook_tls.SECRET_NAME,
                namespace=tenancy_handlers.SETTINGS.namespace,
                resource_version=secret.metadata.resource_version if secret else None,
            ),
            type="Opaque",
            data=material.to_secret_data(),
        )
        try:
            if secret is None:
                core.create_namespaced_secret(tenancy_handlers.SETTINGS.namespace, body)
            else:
                core.replace_namespaced_secret(
                    webhook_tls.SECRET_NAME, tenancy_handlers.SETTINGS.namespace, body
                )
            return material
        except ApiException as exc:
            if exc.status != 409:  # another replica wrote it first: read theirs
                raise
    raise RuntimeError(
        f"could not settle Secret {tenancy_handlers.SETTINGS.namespace}/{webhook_tls.SECRET_NAME}"
    )


# ---------------------------------------------------------------------------------------------------
# Admission


def _charged(services: kopf.Index, tenants: dict[str, TenantSpec], labels: dict) -> dict:
    """(namespace, name) -> (tenant, Held) for every indexed InferenceService."""
    out = {}
    for key, store in services.items():
        for obj in store:
            spec, problems = parse_spec(obj.get("spec") or {})
            if spec is None:
                continue
            c = admission.charge(spec)
            out[key] = (tenant_of(key[0], tenants, labels) or "", admission.Held(key, c.gpu_type, c.gpus))
    return out


def _admit(
    namespace: str, name: str, new_raw: dict, old_raw: dict | None, dryrun: bool, kwargs: dict
) -> None:
    new, _ = parse_spec(new_raw or {})
    if new is None:
        return  # malformed: the CRD schema and the reconciler's Valid condition explain it
    old = parse_spec(old_raw)[0] if old_raw is not None else None
    tenants = _known_tenants(kwargs)
    labels = labels_by_namespace(kwargs["namespace_labels"])
    tenant = tenant_of(namespace, tenants, labels)
    key = (namespace, name)
    with LEDGER.lock():
        others = LEDGER.held(tenant or "", _charged(kwargs["services"], tenants, labels), exclude=key)
        new_charge = admission.charge(new)
        verdict = admission.review(
            key=key,
            tenant=tenant,
            tenant_spec=tenants.get(tenant) if tenant else None,
            new=new_charge,
            old=admission.charge(old) if old is not None else None,
            others=others,
        )
        if verdict.allowed and not dryrun and tenant:
            LEDGER.reserve(tenant, admission.Held(key, new_charge.gpu_type, new_charge.gpus))
    if not verdict.allowed:
        raise kopf.AdmissionError(verdict.message, code=403)


@kopf.on.validate(*ISVC, id="quota", operations=["CREATE", "UPDATE"])
def admit_service(body, old, namespace: str, name: str, dryrun: bool, **kwargs) -> None:
    _admit(namespace, name, body.get("spec"), (old or {}).get("spec") if old else None, dryrun, kwargs)


@kopf.on.validate(*ISVC, id="quota-scale", subresource="scale", operations=["UPDATE"])
def admit_scale(body, namespace: str, name: str, dryrun: bool, **kwargs) -> None:
    """`kubectl scale` changes spec.replicas through the scale subresource; it is charged the same way."""
    API_CALLS.labels(verb="get", resource="inferenceservices").inc()
    current = runtime().kube.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, ISVC[2], name)
    spec = dict(current.get("spec") or {})
    # Scale.spec.replicas is omitted when it is 0 (omitempty).
    new = {**spec, "replicas": (body.get("spec") or {}).get("replicas", 0)}
    _admit(namespace, name, new, spec, dryrun, kwargs)


@kopf.on.validate(GROUP, VERSION, TENANT.plural, id="tenant", operations=["CREATE", "UPDATE"])
def admit_tenant(body, name: str, dryrun: bool, **kwargs) -> None:
    try:
        spec = TenantSpec.model_validate(body.get("spec") or {})
    except ValueError as exc:
        raise kopf.AdmissionError(f"tenant {name}: {exc}", code=422) from exc
    labels = labels_by_namespace(kwargs["namespace_labels"])
    with _tenants_lock:
        others = _known_tenants(kwargs)
        problems = tenant_problems(name, spec, others, labels)
        if not problems and not dryrun:
            _recent_tenants[name] = (spec, time.monotonic() + RECENT_TENANT_SECONDS)
    if problems:
        raise kopf.AdmissionError("; ".join(problems), code=422)
