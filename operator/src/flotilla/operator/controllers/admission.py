"""The admission webhook's handlers (its server: webhook_server.py), loaded only with --webhook-port.

- InferenceServices (create, update, and the scale subresource) are judged by desired.admission: the
  reconciler's own validation, then the Tenant's quota. Each check and its reservation happen under the
  ledger's lock, so concurrent reviews cannot both pass into over-quota.
- Tenants are refused when they claim a namespace another Tenant claims.
"""

from __future__ import annotations

import time

import kopf

from flotilla.operator.api.v1alpha1 import GROUP, INFERENCE_SERVICE, TENANT, VERSION, TenantSpec
from flotilla.operator.controllers.indexes import ISVC, labels_by_namespace, tenant_specs
from flotilla.operator.controllers.state import AdmissionState
from flotilla.operator.desired.admission import charged, review_service
from flotilla.operator.metrics import API_CALLS, DENIALS, INVALID_TENANT, TENANT_CONFLICT
from flotilla.operator.tenancy.quota import Held, Key
from flotilla.operator.tenancy.rules import tenant_of, tenant_problems

# Tenants this webhook admitted are trusted this long while the watch catches up with them.
RECENT_TENANT_SECONDS = 30.0


@kopf.on.validate(*ISVC, id="quota", operations=["CREATE", "UPDATE"])
def admit_service(body, old, namespace: str, name: str, dryrun: bool, memo: kopf.Memo, **kwargs) -> None:
    old_spec = (old or {}).get("spec") if old else None
    _admit(memo.admission, namespace, name, body.get("spec"), old_spec, dryrun, kwargs)


@kopf.on.validate(*ISVC, id="quota-scale", subresource="scale", operations=["UPDATE"])
def admit_scale(body, namespace: str, name: str, dryrun: bool, memo: kopf.Memo, **kwargs) -> None:
    """`kubectl scale` changes spec.replicas through the scale subresource; it is charged the same way."""
    API_CALLS.labels(verb="get", resource="inferenceservices").inc()
    custom = memo.runtime.kube.custom
    current = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, ISVC[2], name)
    spec = dict(current.get("spec") or {})
    # Scale.spec.replicas is omitted when it is 0 (omitempty).
    new = {**spec, "replicas": (body.get("spec") or {}).get("replicas", 0)}
    _admit(memo.admission, namespace, name, new, spec, dryrun, kwargs)


@kopf.on.validate(GROUP, VERSION, TENANT.plural, id="tenant", operations=["CREATE", "UPDATE"])
def admit_tenant(body, name: str, dryrun: bool, memo: kopf.Memo, **kwargs) -> None:
    state: AdmissionState = memo.admission
    try:
        spec = TenantSpec.model_validate(body.get("spec") or {})
    except ValueError as exc:
        DENIALS.labels(name, INVALID_TENANT).inc()
        raise kopf.AdmissionError(f"tenant {name}: {exc}", code=422) from exc
    labels = labels_by_namespace(kwargs["namespace_labels"])
    with state.tenants_lock:
        others = _known_tenants(state, kwargs)
        problems = tenant_problems(name, spec, others, labels)
        if not problems and not dryrun:
            state.recent_tenants[name] = (spec, time.monotonic() + RECENT_TENANT_SECONDS)
    if problems:
        DENIALS.labels(name, TENANT_CONFLICT).inc()
        raise kopf.AdmissionError("; ".join(problems), code=422)


# ---------------------------------------------------------------------------------------------------


def _admit(
    state: AdmissionState,
    namespace: str,
    name: str,
    new_raw: dict,
    old_raw: dict | None,
    dryrun: bool,
    kwargs: dict,
) -> None:
    tenants = _known_tenants(state, kwargs)
    labels = labels_by_namespace(kwargs["namespace_labels"])
    tenant = tenant_of(namespace, tenants, labels)
    key = (namespace, name)
    with state.held.lock:
        state.held.settle(_charged(kwargs["services"], tenants, labels))
        verdict, held = review_service(
            key=key,
            new_raw=new_raw or {},
            old_raw=old_raw,
            tenant=tenant,
            tenant_spec=tenants.get(tenant) if tenant else None,
            others=state.held.others(key, tenant or ""),
        )
        if verdict.allowed and not dryrun and held is not None:
            state.held.reserve(held)
    if not verdict.allowed:
        DENIALS.labels(tenant or "", verdict.reason).inc()
        raise kopf.AdmissionError(verdict.message, code=verdict.code)


def _charged(services: kopf.Index, tenants: dict[str, TenantSpec], labels: dict) -> dict[Key, Held]:
    """What every indexed InferenceService is charged."""
    out = {}
    for key, store in services.items():
        for obj in store:
            held = charged(key, tenant_of(key[0], tenants, labels) or "", obj.get("spec") or {})
            if held is not None:
                out[key] = held
    return out


def _known_tenants(state: AdmissionState, kwargs: dict) -> dict[str, TenantSpec]:
    """The tenants index, plus Tenants this webhook admitted moments ago that the watch has not delivered
    yet (newest first): `kubectl apply` of a Tenant and its first service together must not race."""
    with state.tenants_lock:
        now = time.monotonic()
        for name, (_, expiry) in list(state.recent_tenants.items()):
            if expiry <= now:
                del state.recent_tenants[name]
        recent = {name: spec for name, (spec, _) in state.recent_tenants.items()}
    return {**tenant_specs(kwargs["tenants"]), **recent}


# The suffix of each webhook's name in the ValidatingWebhookConfiguration (`quota.flotilla.dev`, ...).
WEBHOOK_NAME_SUFFIX = GROUP


def webhook_definitions() -> list[dict]:
    """kopf's own description of the webhooks above, for a ValidatingWebhookConfiguration that someone
    else writes (the Helm chart): each entry as kopf would manage it, with `path` (the handler's URL path
    under the server) in place of a client config. One source for the rules, the chart reads it."""
    from kopf._cogs.structs import references  # kopf's builder is internal; kopf is pinned
    from kopf._core.engines.admission import build_webhooks

    resources = [
        references.Resource(GROUP, VERSION, kind.plural, kind=kind.kind, namespaced=kind is INFERENCE_SERVICE)
        for kind in (INFERENCE_SERVICE, TENANT)
    ]
    handlers = kopf.get_default_registry()._webhooks.get_all_handlers()  # noqa: SLF001
    hooks = build_webhooks(
        handlers,
        resources=resources,
        name_suffix=WEBHOOK_NAME_SUFFIX,
        client_config={"service": {"path": ""}},
    )
    out = []
    for hook in hooks:
        path = hook.pop("clientConfig")["service"]["path"]
        hook.pop("timeoutSeconds", None)  # a chart value
        hook.pop("failurePolicy", None)  # a chart value
        out.append({**{k: v for k, v in hook.items() if v is not None}, "path": path})
    return sorted(out, key=lambda h: h["name"])
