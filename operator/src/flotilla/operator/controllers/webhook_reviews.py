"""The admission webhook's reviews: its kopf handlers (its server: webhook_server.py; its certificates:
webhook_tls.py), loaded only with --webhook-port.

Every operator replica answers reviews (the API server spreads them over the webhook Service's pods), and
a standby's watch indexes are paused, so reviews read nothing from indexes: each reads the Tenants and
namespaces fresh from the API, then the tenant's reservations from a ConfigMap that it writes with
optimistic concurrency (tenancy/reservations.py), then the stored objects it counts. Two reviews of one
tenant, on any replicas, serialize on that write; the loser reads again and decides again.

- InferenceServices (create, update, and the scale subresource) are judged by `review_service` below:
  the reconciler's own validation (desired.validation.check, with the host-path roots the operator allows:
  a file:// model or an adapterDir outside them is refused here and by the reconciler alike), then the
  Tenant's quota (tenancy.quota_review). The rules that depend on the world (GPU types on the nodes, model
  paths) are left to the reconciler: the world changes (a node joins, a volume is filled) and the reconciler
  re-checks them when it does, while admission is asked once.
- LoRAAdapters are refused when their spec is invalid (desired.lora_adapter.check: the source's scheme),
  when their base is in a namespace the adapter's tenant may not use (desired.lora_adapter.sharing_problem),
  then (so that such a base is never read) when their base exists, serves adapters and mounts neither the
  folder nor the claim a file:// or pvc:// source names (desired.lora_adapter.mount_problem: the stored
  base, read fresh; a base created or changed later is the Ready condition's, as are its other rules),
  and, on create, past their Tenant's spec.maxLoRAAdapters (tenancy.lora_limit): `admit_adapter` counts
  the stored adapters and the live adapter reservations, and reserves the one it admits in the same
  ConfigMap, the same way as GPU quota.
- Tenants are refused when they claim a namespace another Tenant claims, stored or admitted moments ago
  (the claims ConfigMap, written the same way).

Reviews run on threads of their own (`memo.reviews`, state.py), never on kopf's executor: kopf runs every sync
handler there, and an operator that has just started (a rolling update, a failover) fills it with the resume
of every object it serves; a review queued behind them would outlive the API server's webhook timeout, and
with failurePolicy Fail the tenant's request would fail rather than be judged.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

import kopf
from kubernetes.client.exceptions import ApiException

from flotilla.operator.api.v1alpha1 import GROUP, INFERENCE_SERVICE, LORA_ADAPTER, TENANT, VERSION, TenantSpec
from flotilla.operator.clients.quota_ledger import QuotaLedger, World
from flotilla.operator.controllers import failpoints
from flotilla.operator.controllers.indexes import ISVC
from flotilla.operator.desired import lora_adapter
from flotilla.operator.desired.validation import check, describe, parse_spec
from flotilla.operator.metrics import API_CALLS, DENIALS, INVALID_TENANT, TENANT_CONFLICT
from flotilla.operator.tenancy.lora_limit import adapter_limit_refusal
from flotilla.operator.tenancy.quota import Held, Key
from flotilla.operator.tenancy.quota_review import Verdict, charge, review
from flotilla.operator.tenancy.reservations import (
    RESERVATION_TTL_SECONDS,
    AdapterReservation,
    Reservation,
    Reserved,
    Stored,
    charges,
    claims_data,
    live,
    live_adapters,
    pending_claims,
)
from flotilla.operator.tenancy.rules import namespaces_owned, owner_of, tenant_problems

log = logging.getLogger("flotilla.operator.admission")

# A review that loses the reservation write this often to concurrent reviews of the same tenant gives up
# with a retryable refusal (within the API server's webhook timeout) rather than guess.
MAX_ATTEMPTS = 40
LEDGER_BUSY = 429
# Verdicts that change no charge reserve nothing.
UNCHARGED = ("NotRaised", "Unchanged")


def _until_written(attempt: Callable[[], bool | None], who: str, what: str, denial_label: str) -> None:
    """Runs `attempt` until its conditional write to the ledger lands. Each attempt decides on a fresh read
    and raises to refuse; it returns None when there is nothing to write, else whether its write landed
    (False: another review of the same ledger wrote first, so decide again on what that one wrote). A little
    jitter keeps a burst of reviews from colliding round after round; after MAX_ATTEMPTS a retryable
    refusal, never a guess."""
    for tries in range(MAX_ATTEMPTS):
        if attempt() is not False:
            return
        time.sleep(random.uniform(0, 0.02 * (tries + 1)))
    DENIALS.labels(denial_label, "LedgerBusy").inc()
    raise kopf.AdmissionError(
        f"{who}: {MAX_ATTEMPTS} concurrent reviews {what} before this one; nothing was admitted, retry the request",
        code=LEDGER_BUSY,
    )


def admit_service(body, old, namespace: str, name: str, dryrun: bool, memo: kopf.Memo, **_) -> None:
    old_spec = (old or {}).get("spec") if old else None
    uid = (body.get("metadata") or {}).get("uid") or ""
    roots = memo.runtime.config.host_path_roots
    _admit(memo.admission, namespace, name, uid, body.get("spec"), old_spec, dryrun, host_path_roots=roots)


def admit_scale(body, namespace: str, name: str, dryrun: bool, memo: kopf.Memo, **_) -> None:
    """`kubectl scale` changes spec.replicas through the scale subresource; it is charged the same way."""
    API_CALLS.labels(verb="get", resource="inferenceservices").inc()
    custom = memo.runtime.kube.custom
    current = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, ISVC[2], name)
    spec = dict(current.get("spec") or {})
    # Scale.spec.replicas is omitted when it is 0 (omitempty).
    new = {**spec, "replicas": (body.get("spec") or {}).get("replicas", 0)}
    uid = (current.get("metadata") or {}).get("uid") or ""
    roots = memo.runtime.config.host_path_roots
    _admit(memo.admission, namespace, name, uid, new, spec, dryrun, host_path_roots=roots)


def admit_tenant(body, name: str, memo: kopf.Memo, dryrun: bool = False, **_) -> None:
    """Refuses a Tenant that claims a namespace another claims, stored or admitted moments ago: two
    Tenants applied at once, on any replicas, serialize on the claims ConfigMap's write."""
    ledger: QuotaLedger = memo.admission
    try:
        spec = TenantSpec.model_validate(body.get("spec") or {})
    except ValueError as exc:
        DENIALS.labels(name, INVALID_TENANT).inc()
        raise kopf.AdmissionError(f"tenant {name}: {exc}", code=422) from exc

    def attempt() -> bool | None:
        world = ledger.world()
        data, version = ledger.read_claims()
        now = time.time()
        pending = pending_claims(data, {n: s.to_wire() for n, s in world.tenants.items()}, now)
        in_flight = {n: TenantSpec.model_validate(raw) for n, (raw, _) in pending.items() if n != name}
        problems = tenant_problems(name, spec, world.tenants, world.labels)
        problems += [p for p in tenant_problems(name, spec, in_flight, world.labels) if p not in problems]
        if problems:
            DENIALS.labels(name, TENANT_CONFLICT).inc()
            raise kopf.AdmissionError("; ".join(problems), code=422)
        if dryrun:
            return None
        claims = {**pending, name: (spec.to_wire(), now + RESERVATION_TTL_SECONDS)}
        return ledger.write_claims(claims_data(claims), version)

    _until_written(attempt, f"tenant {name}", "of Tenants wrote their claims", name)


def _stored_service(memo: kopf.Memo, namespace: str, name: str) -> dict | None:
    """The stored InferenceService, read fresh; None when there is none, or when it cannot be read (the
    review then leaves the base's rules to the adapter's Ready condition rather than refuse on a guess)."""
    API_CALLS.labels(verb="get", resource=INFERENCE_SERVICE.plural).inc()
    try:
        return memo.runtime.kube.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, ISVC[2], name)
    except ApiException as exc:
        if exc.status != 404:
            log.warning(
                "InferenceService %s/%s could not be read (%s): not checked", namespace, name, exc.status
            )
        return None


def admit_adapter(body, old, namespace: str, name: str, memo: kopf.Memo, dryrun: bool = False, **_) -> None:
    spec_raw = body.get("spec") or {}
    if old and (old.get("spec") or {}) == spec_raw:
        return  # the operator's own writes (finalizers, annotations, status)
    spec, problems = lora_adapter.check(spec_raw)
    if problems or spec is None:
        DENIALS.labels("", problems[0].reason).inc()
        raise kopf.AdmissionError(f"LoRAAdapter {namespace}/{name}: {describe(problems)}", code=422)
    ledger: QuotaLedger = memo.admission
    base_ns = lora_adapter.base_namespace(namespace, spec)
    if base_ns != namespace:  # a base in another namespace: one the adapter's tenant may use
        world = ledger.world()
        mine = owner_of(namespace, world.tenants, world.labels)
        refusal = lora_adapter.sharing_problem(mine, owner_of(base_ns, world.tenants, world.labels))
        if refusal is not None:
            DENIALS.labels(mine.tenant or "", refusal[0]).inc()
            raise kopf.AdmissionError(f"LoRAAdapter {namespace}/{name}: {refusal[1]}", code=403)
    # Only then the base's mounts: a base the tenant may not use is never read, so its folder and claim are
    # never shown to it.
    path = lora_adapter.adapter_path(spec.source)
    if not lora_adapter.is_fetched(path):  # a folder the base's replicas must mount: do they?
        base = _stored_service(memo, base_ns, spec.inference_service)
        claim = lora_adapter.source_claim(spec.source)
        unseen = lora_adapter.mount_problem(base_ns, spec.inference_service, base, path, claim)
        if unseen is not None:
            DENIALS.labels("", unseen[0]).inc()
            raise kopf.AdmissionError(f"LoRAAdapter {namespace}/{name}: {unseen[1]}", code=422)
    if old:
        return  # the limit counts objects: only a create adds one
    uid = (body.get("metadata") or {}).get("uid") or ""
    _admit_adapter(ledger, (namespace, name), uid, dryrun)


def _admit_adapter(ledger: QuotaLedger, key: Key, uid: str, dryrun: bool) -> None:
    """The Tenant's maxLoRAAdapters on a create: counted over its stored adapters and its live adapter
    reservations, and the admitted create reserved in the tenant's ConfigMap, as `_admit` does for GPUs."""
    namespace, name = key

    def attempt() -> bool | None:
        world = ledger.world()
        tenant = owner_of(namespace, world.tenants, world.labels).tenant
        limit = world.tenants[tenant].max_lora_adapters if tenant in world.tenants else None
        if tenant is None or limit is None:
            return None
        # The reservations first, then the stored adapters (tenancy/reservations.py says why).
        reserved, version = ledger.read(tenant)
        owned = set(namespaces_owned(tenant, world.tenants, world.labels))
        stored = [k for k in ledger.adapters() if k[0] in owned]
        now = time.time()
        pending = live_adapters(reserved.adapters, stored, now)
        refusal = adapter_limit_refusal(
            tenant=tenant, limit=limit, namespace=namespace, name=name, existing=stored,
            reserved=[a.key for a in pending],
        )  # fmt: skip
        if refusal:
            DENIALS.labels(tenant, "MaxLoRAAdaptersExceeded").inc()
            raise kopf.AdmissionError(refusal, code=403)
        if dryrun:
            return None
        mine = AdapterReservation(key, uid, now + RESERVATION_TTL_SECONDS)
        updated = reserved.unexpired(now).with_adapters([*(a for a in pending if a.key != key), mine])
        return ledger.write(tenant, world.tenant_uids.get(tenant, ""), updated, version)

    _until_written(
        attempt, f"LoRAAdapter {namespace}/{name}", "of the same tenant's limits won the reservation", ""
    )


def on_review_threads(review: Callable[..., None]) -> Callable[..., Awaitable[None]]:
    """The kopf handler that runs the sync `review` on `memo.reviews` (kopf awaits a coroutine handler in its
    event loop, and only sends sync ones to its executor), with kopf's context (its logging) carried over.
    Not functools.wraps: kopf follows `__wrapped__` to decide whether a handler is a coroutine."""

    async def handler(**kwargs) -> None:
        call = functools.partial(contextvars.copy_context().run, review, **kwargs)
        await asyncio.get_running_loop().run_in_executor(kwargs["memo"].reviews, call)

    handler.__name__ = handler.__qualname__ = review.__name__
    return handler


# kopf's handlers: the reviews above, each on memo.reviews. The names stay the plain sync reviews (tests call them).
kopf.on.validate(*ISVC, id="quota", operations=["CREATE", "UPDATE"])(on_review_threads(admit_service))
kopf.on.validate(*ISVC, id="quota-scale", subresource="scale", operations=["UPDATE"])(
    on_review_threads(admit_scale)
)
kopf.on.validate(GROUP, VERSION, TENANT.plural, id="tenant", operations=["CREATE", "UPDATE"])(
    on_review_threads(admit_tenant)
)
kopf.on.validate(GROUP, VERSION, LORA_ADAPTER.plural, id="lora-adapter", operations=["CREATE", "UPDATE"])(
    on_review_threads(admit_adapter)
)


# ---------------------------------------------------------------------------------------------------


def _admit(
    ledger: QuotaLedger,
    namespace: str,
    name: str,
    uid: str,
    new_raw: dict,
    old_raw: dict | None,
    dryrun: bool,
    *,
    host_path_roots: Sequence[str],
) -> None:
    key = (namespace, name)
    if old_raw is not None and (new_raw or {}) == old_raw:
        return  # the operator's own writes (annotations, finalizers, status): no charge changes, no reads

    def attempt() -> bool | None:
        world = ledger.world()
        claim = owner_of(namespace, world.tenants, world.labels)
        tenant = claim.tenant
        # The reservations first, then the stored services (tenancy/reservations.py says why).
        reserved, version = ledger.read(tenant) if tenant else (Reserved(), None)
        now = time.time()
        stored = _stored(world, tenant, ledger.services()) if tenant else {}
        reservations = live(reserved.services, stored, now)
        verdict, held = review_service(
            key=key,
            new_raw=new_raw or {},
            old_raw=old_raw,
            tenant=tenant,
            tenant_spec=world.tenants.get(tenant) if tenant else None,
            others=[h for h in charges(stored, reservations) if h.key != key],
            contest=claim.contest_message() if claim.contested else None,
            host_path_roots=host_path_roots,
        )
        if not verdict.allowed:
            DENIALS.labels(tenant or "", verdict.reason).inc()
            raise kopf.AdmissionError(verdict.message, code=verdict.code)
        if dryrun or held is None or tenant is None or verdict.reason in UNCHARGED:
            return None
        mine = Reservation(held, uid, now + RESERVATION_TTL_SECONDS)
        updated = reserved.unexpired(now).with_services([*(r for r in reservations if r.key != key), mine])
        written = ledger.write(tenant, world.tenant_uids.get(tenant, ""), updated, version)
        if written:
            failpoints.reached("admission.reserved")
        return written

    _until_written(
        attempt, f"InferenceService {namespace}/{name}", "of the same tenant's quota won the reservation", ""
    )


def review_service(
    *,
    key: Key,
    new_raw: dict,
    old_raw: dict | None,
    tenant: str | None,
    tenant_spec: TenantSpec | None,
    others: Iterable[Held],
    host_path_roots: Sequence[str],
    contest: str | None = None,
) -> tuple[Verdict, Held | None]:
    """The verdict on a create (`old_raw` None) or an update of the spec, and what the service is charged
    once admitted (None when nothing is). Pure: the webhook's counterpart of desired.reconcile.plan, built
    from the same parts. `host_path_roots`: OperatorConfig.host_path_roots, required so that no caller
    judges host paths by forgetting them."""
    new, problems = check(new_raw, host_path_roots=host_path_roots)
    if problems and new_raw != old_raw:
        # Only a changed spec is judged: the operator's own writes (finalizers, annotations) to an object
        # stored before the webhook was on must pass, or it could never be deleted.
        return Verdict(False, describe(problems), problems[0].reason, code=422), None
    if new is None:
        return Verdict(True, "the spec did not change", "Unchanged"), None
    old = parse_spec(old_raw)[0] if old_raw is not None else None
    new_charge = charge(new)
    verdict = review(
        key=key,
        tenant=tenant,
        tenant_spec=tenant_spec,
        new=new_charge,
        old=charge(old) if old is not None else None,
        others=others,
        contest=contest,
    )
    held = Held(key, tenant, new_charge.gpu_type, new_charge.gpus) if tenant else None
    return verdict, held


def charged(key: Key, tenant: str, raw_spec: dict) -> Held | None:
    """What a stored service is charged (None when its spec does not parse)."""
    spec, _ = parse_spec(raw_spec)
    if spec is None:
        return None
    c = charge(spec)
    return Held(key, tenant, c.gpu_type, c.gpus)


def _stored(world: World, tenant: str, services: dict[Key, dict]) -> dict[Key, Stored]:
    """The tenant's stored InferenceServices, with what each is charged."""
    out = {}
    owned = set(namespaces_owned(tenant, world.tenants, world.labels))
    for key, obj in services.items():
        if key[0] not in owned:
            continue
        meta = obj.get("metadata") or {}
        out[key] = Stored(meta.get("uid") or "", charged(key, tenant, obj.get("spec") or {}))
    return out


# The suffix of each webhook's name in the ValidatingWebhookConfiguration (`quota.flotilla.dev`, ...).
WEBHOOK_NAME_SUFFIX = GROUP


def webhook_definitions() -> list[dict]:
    """kopf's own description of the webhooks above, for a ValidatingWebhookConfiguration that someone
    else writes (the Helm chart): each entry as kopf would manage it, with `path` (the handler's URL path
    under the server) in place of a client config. One source for the rules, the chart reads it."""
    from kopf._cogs.structs import references  # kopf's builder is internal; kopf is pinned
    from kopf._core.engines.admission import build_webhooks

    resources = [
        references.Resource(GROUP, VERSION, kind.plural, kind=kind.kind, namespaced=kind is not TENANT)
        for kind in (INFERENCE_SERVICE, TENANT, LORA_ADAPTER)
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
