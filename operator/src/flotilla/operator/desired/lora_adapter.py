"""Desired state of a LoRAAdapter: pure decisions from its spec, its base InferenceService, the base's ready
replicas and what each replica's engine says it serves (GET /v1/models) to the calls to make (load,
reload, nothing) and to the adapter's status. No I/O here: controllers/lora_adapters.py makes the calls
(clients/engine_lora.py) and writes the status this module computes.

The adapter's name in the engine (served_name) is the object's name when the base service is in the
adapter's namespace, and `namespace/name` when it is in another one (a shared base, where adapters of
several namespaces meet): either way two adapters of one engine never share a name. Whether an adapter may
use a base in another namespace is flotilla.ownership.adapter_may_use (the one rule; sharing_problem words
its refusal for the webhook and the Ready condition alike).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlsplit

from pydantic import ValidationError

from flotilla import ownership
from flotilla.contract import engine_base_url
from flotilla.fetch_uri import FetchError, parse_fetch_uri, redact_uri
from flotilla.operator.api.conditions import is_ready
from flotilla.operator.api.v1alpha1 import (
    LORA_SOURCE_SCHEMES,
    AdapterReplica,
    Condition,
    InferenceServiceSpec,
    LoRAAdapterSpec,
    LoRASettings,
)
from flotilla.operator.desired.model_source import LORA_ADAPTER_CLAIM, claim_mount, parse_claim_uri
from flotilla.operator.desired.validation import Problem
from flotilla.ownership import Owner

VALID = "Valid"
READY = "Ready"

LOADING, LOADED, FAILED = "Loading", "Loaded", "Failed"


# -- the spec -------------------------------------------------------------------------------------------------
SOURCE_ACCEPTED = (
    "accepted: file:///absolute/path (a folder under the base's spec.engine.lora.adapterDir), "
    "pvc://<claim>/<folder> (a folder in the base's spec.engine.lora.adapterClaim), "
    "hf://org/name[@revision], or http(s)://…/adapter.tar.gz (or .tgz, .tar; optional #sha256=<64 hex "
    "digits>), which each replica's engine fetches itself"
)
FETCHED_SCHEMES = ("hf", "http", "https")


def adapter_path(source: str) -> str:
    """What the operator sends as lora_path: the folder a `file:///abs/path` source names (normalized as
    the engine reports it); for `pvc://<claim>/<folder>`, that folder where the replicas mount the base's
    adapterClaim (model_source.claim_mount, LORA_ADAPTER_CLAIM's root); an hf:// or http(s):// source as
    written (the engine fetches it). A ValueError names the field, the value (without secrets) and what
    is accepted otherwise."""
    shown = redact_uri(source)
    parts = urlsplit(source)
    scheme = parts.scheme.lower()
    if scheme not in LORA_SOURCE_SCHEMES:
        named = f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
        raise ValueError(f"spec.source {shown!r}: {named} is not supported; {SOURCE_ACCEPTED}")
    if scheme in FETCHED_SCHEMES:
        try:
            parse_fetch_uri(source)  # the engine's own parser: what it accepts, the webhook accepts
        except FetchError as exc:
            raise ValueError(f"spec.source {shown!r}: {exc}; {SOURCE_ACCEPTED}") from None
        return source
    if scheme == "pvc":
        try:
            claim, folder = parse_claim_uri(source)  # a pvc:// model uri's rules
        except ValueError as exc:
            raise ValueError(f"spec.source {shown!r}: {exc}; {SOURCE_ACCEPTED}") from None
        return claim_mount(claim, folder, LORA_ADAPTER_CLAIM).path
    if parts.netloc or not parts.path.startswith("/") or parts.query or parts.fragment:
        raise ValueError(f"spec.source {shown!r}: not a file URI of an absolute path; {SOURCE_ACCEPTED}")
    return posixpath.normpath(parts.path)


def source_claim(source: str) -> str | None:
    """The claim a valid pvc:// source names (the base's adapterClaim must be it); None for other schemes."""
    return parse_claim_uri(source)[0] if urlsplit(source).scheme.lower() == "pvc" else None


def is_fetched(path: str) -> bool:
    """Whether an adapter_path is a URI the engine fetches (not a folder on the node)."""
    return not path.startswith("/")


def shown_path(path: str) -> str:
    """What an engine reports as the `root` of an adapter loaded from adapter_path `path` (GET /v1/models),
    and what status messages show: the folder, or the URI without its secrets (a presigned URL's query)."""
    return redact_uri(path) if is_fetched(path) else path


def check(raw: Mapping) -> tuple[LoRAAdapterSpec | None, list[Problem]]:
    """The typed spec (None when it does not parse) and every problem with it: the webhook's refusals and
    the Valid condition, worded alike."""
    try:
        spec = LoRAAdapterSpec.model_validate(dict(raw or {}))
    except ValidationError as exc:
        problems = [
            Problem("spec." + ".".join(str(p) for p in err["loc"]), err["msg"], "InvalidSpec")
            for err in exc.errors()
        ]
        return None, problems
    try:
        adapter_path(spec.source)
    except ValueError as exc:
        field, _, message = str(exc).partition(" ")
        return spec, [Problem(field, message, "InvalidSource")]
    return spec, []


def base_namespace(namespace: str, spec: LoRAAdapterSpec) -> str:
    """The base service's namespace: spec.serviceNamespace, or the adapter's own."""
    return spec.service_namespace or namespace


def served_name(name: str, namespace: str, base_ns: str) -> str:
    """The adapter's name in its base's engines: the object's name on a base in its own namespace (names
    are unique there); `namespace/name` on a base in another namespace, where adapters of several
    namespaces meet ('/' is in no Kubernetes name, so it never equals a same-namespace adapter's name)."""
    return name if base_ns == namespace else f"{namespace}/{name}"


SHARING_RULE = (
    "an adapter's base service must be in the adapter's own namespace, in a namespace of the platform's "
    "shared Tenant (spec.shared: true), or in another namespace of the adapter's own tenant"
)


def sharing_problem(adapter: Owner, base: Owner) -> tuple[str, str] | None:
    """Why an adapter in `adapter`'s namespace may not use a base service in `base`'s, as (reason, message)
    naming the field and its value; None when it may (ownership.adapter_may_use). Never names another
    tenant."""
    if ownership.adapter_may_use(adapter, base):
        return None
    if adapter.contested:
        why = (
            f"the adapter's namespace {adapter.namespace} is claimed by several Tenants, so it has no tenant"
        )
    elif base.contested:
        why = f"namespace {base.namespace} is claimed by several Tenants, so nobody may use its services"
    elif adapter.tenant is None:
        why = (
            f"the adapter's namespace {adapter.namespace} belongs to no tenant, so its adapters may use no "
            "other namespace's services"
        )
    elif base.tenant is None:
        why = f"namespace {base.namespace} belongs to no tenant, so nobody may use its services"
    else:
        why = f"namespace {base.namespace} does not belong to tenant {adapter.tenant}, nor is it shared"
    return "BaseNotShared", f"spec.serviceNamespace {base.namespace!r}: {why}; {SHARING_RULE}"


def base_problem(
    name: str, namespace: str, service: str, base: Mapping | None, path: str, claim: str | None = None
) -> tuple[str, str] | None:
    """Why the base service `namespace/service` cannot take the adapter (`name`: its served name) from
    `path` (adapter_path; `claim`: source_claim, for a pvc:// source), as (reason, message); None when it
    can. Its replicas see only the node folder its spec.engine.lora.adapterDir mounts and the claim its
    adapterClaim mounts, so the path must lie in one of them (mount_problem)."""
    if base is None:
        return "BaseServiceNotFound", f"InferenceService {namespace}/{service} does not exist"
    try:
        spec = InferenceServiceSpec.model_validate(base.get("spec") or {})
    except ValidationError:
        return "BaseServiceInvalid", f"InferenceService {namespace}/{service} has a spec that does not parse"
    if spec.engine.lora is None or not spec.engine.lora.enabled:
        return (
            "LoRANotEnabled",
            f"InferenceService {namespace}/{service} does not serve adapters: set its spec.engine.lora.enabled "
            "to true",
        )
    served = spec.model.served_name or service
    if served == name:
        return (
            "NameTaken",
            f"the adapter's name {name!r} is the served model name of InferenceService {namespace}/{service}; "
            "requests could not tell them apart: name the LoRAAdapter otherwise",
        )
    return _mount_problem(namespace, service, spec.engine.lora, path, claim)


def mount_problem(
    namespace: str, service: str, base: Mapping | None, path: str, claim: str | None = None
) -> tuple[str, str] | None:
    """Why the replicas of an existing base that serves adapters cannot see the source (`path`, `claim`
    as for base_problem), as (reason, message); None when they can, and when that is not known: no base,
    one that does not parse or does not serve adapters (base_problem's other reasons, which the webhook
    leaves to the Ready condition, since a base may be created or changed after its adapters)."""
    if base is None:
        return None
    try:
        spec = InferenceServiceSpec.model_validate(base.get("spec") or {})
    except ValidationError:
        return None
    if spec.engine.lora is None or not spec.engine.lora.enabled:
        return None
    return _mount_problem(namespace, service, spec.engine.lora, path, claim)


def _mount_problem(
    namespace: str, service: str, lora: LoRASettings, path: str, claim: str | None
) -> tuple[str, str] | None:
    if is_fetched(path):
        return None  # each replica's engine fetches it into its own cache: no node folder is involved
    if claim is not None:
        source = f"pvc://{claim}/{posixpath.relpath(path, claim_mount(claim, '', LORA_ADAPTER_CLAIM).path)}"
        if not lora.adapter_claim:
            return (
                "NoAdapterClaim",
                f"spec.source {source!r}: InferenceService {namespace}/{service} sets no "
                f"spec.engine.lora.adapterClaim, so its replicas mount no claim to load it from: set adapterClaim "
                f"to {claim!r} there",
            )
        if lora.adapter_claim != claim:
            return (
                "SourceOutsideAdapterClaim",
                f"spec.source {source!r}: claim {claim!r} is not {lora.adapter_claim!r}, the "
                f"spec.engine.lora.adapterClaim of InferenceService {namespace}/{service}: its replicas mount "
                f"only that claim (accepted: pvc://{lora.adapter_claim}/<folder>)",
            )
        return None
    folder = lora.adapter_dir
    if not folder:
        return (
            "NoAdapterDir",
            f"InferenceService {namespace}/{service} sets no spec.engine.lora.adapterDir, so its replicas see no "
            f"node folder to load spec.source {path} from: set it to a folder on the nodes that holds the adapter",
        )
    folder = posixpath.normpath(folder)
    if posixpath.commonpath([folder, path]) != folder or path == folder:
        return (
            "SourceOutsideAdapterDir",
            f"spec.source {path} is not under {folder}, the spec.engine.lora.adapterDir of InferenceService "
            f"{namespace}/{service}: its replicas see only that folder",
        )
    return None


# -- the replicas ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Replica:
    """A ready engine pod of the base service: its name and its OpenAI base URL."""

    pod: str
    url: str


def ready_replicas(pods: Iterable[Mapping]) -> list[Replica]:
    """The ready, not terminating pods (as the operator's pod index holds them), by name."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if is_ready(pod) and status.get("podIP") and meta.get("name") and not meta.get("deletionTimestamp"):
            out.append(Replica(meta["name"], engine_base_url(status["podIP"])))
    return sorted(out, key=lambda r: r.pod)


def served_adapters(models: Mapping) -> dict[str, str]:
    """GET /v1/models' adapters: name -> root, the folder (normalized) or the URI it was fetched from, as
    the engine shows it (entries with a parent are adapters)."""
    out = {}
    for m in models.get("data") or []:
        if isinstance(m, Mapping) and m.get("parent") and m.get("id"):
            root = str(m.get("root") or "")
            out[m["id"]] = root if is_fetched(root) else posixpath.normpath(root)
    return out


class Step(Enum):
    NOTHING = "nothing"  # served from this folder already
    LOAD = "load"
    RELOAD = "reload"  # served from another folder (the source changed): unload, then load


def step(name: str, path: str, served: Mapping[str, str]) -> Step:
    if name not in served:
        return Step.LOAD
    return Step.NOTHING if served[name] == shown_path(path) else Step.RELOAD


@dataclass(frozen=True)
class Outcome:
    """What one replica's round came to: a phase and why."""

    phase: str
    reason: str = ""
    message: str = ""


def load_outcome(
    code: int, message: str, served_after: Mapping[str, str] | None, name: str, path: str
) -> Outcome:
    """The outcome of POST /v1/load_lora_adapter (code 0: no answer). A 400 may be a load that raced another
    (the name is taken, by this very folder): `served_after` is the listing read after it."""
    shown = shown_path(path)
    if code == 200 or (served_after is not None and served_after.get(name) == shown):
        return Outcome(LOADED, "Loaded", f"loaded from {shown}")
    if 400 <= code < 500 and code not in (408, 429):
        return Outcome(FAILED, "LoadRefused", f"the engine refused the adapter ({code}): {message}")
    # Unanswered, 5xx, or busy: the engine may be starting or overloaded; the next round tries again.
    return Outcome(LOADING, "LoadPending", f"not loaded yet ({code or 'no answer'}): {message}"[:1024])


def replica_entries(
    outcomes: Mapping[str, Outcome], previous: Sequence[Mapping], now: str
) -> list[AdapterReplica]:
    """status.replicas, one entry per replica in `outcomes`, keeping an entry's lastTransitionTime while its
    phase stays (so that a round that changes nothing writes nothing)."""
    before = {p.get("pod"): p for p in previous if isinstance(p, Mapping)}
    out = []
    for pod in sorted(outcomes):
        outcome = outcomes[pod]
        old = before.get(pod) or {}
        since = old.get("lastTransitionTime") if old.get("phase") == outcome.phase else None
        out.append(
            AdapterReplica(
                pod=pod,
                phase=outcome.phase,  # type: ignore[arg-type]
                reason=outcome.reason,
                message=outcome.message,
                last_transition_time=since or now,
            )
        )
    return out


def _condition(type_: str, ok: bool, reason: str, message: str, generation: int | None) -> Condition:
    return Condition(
        type=type_,
        status="True" if ok else "False",
        reason=reason,
        message=message,
        observed_generation=generation,
    )


def conditions(
    *,
    invalid: str | None,
    blocked: tuple[str, str] | None,
    replicas: Sequence[AdapterReplica],
    generation: int | None,
) -> list[Condition]:
    """Valid (the spec), and Ready: True when the adapter is loaded in every ready replica, of which there is
    at least one."""
    valid = _condition(VALID, invalid is None, "Invalid" if invalid else "Valid", invalid or "", generation)
    if invalid is not None:
        return [valid, _condition(READY, False, "Invalid", invalid, generation)]
    if blocked is not None:
        return [valid, _condition(READY, False, blocked[0], blocked[1], generation)]
    if not replicas:
        return [
            valid,
            _condition(READY, False, "NoReadyReplicas", "the base service has no ready replica", generation),
        ]
    failed = [r for r in replicas if r.phase == FAILED]
    waiting = [r for r in replicas if r.phase == LOADING]
    if failed:
        first = failed[0]
        message = f"{len(failed)} of {len(replicas)} replicas failed to load it; {first.pod}: {first.message}"
        return [valid, _condition(READY, False, "LoadFailed", message, generation)]
    if waiting:
        message = f"loaded in {len(replicas) - len(waiting)} of {len(replicas)} ready replicas"
        return [valid, _condition(READY, False, "Loading", message, generation)]
    return [
        valid,
        _condition(READY, True, "Loaded", f"loaded in all {len(replicas)} ready replicas", generation),
    ]


def with_transition_times(new: Sequence[Condition], previous: Sequence[Mapping], now: str) -> list[dict]:
    """The conditions as the API stores them, a condition's lastTransitionTime kept while its status stays."""
    before = {c.get("type"): c for c in previous if isinstance(c, Mapping)}
    out = []
    for cond in new:
        old = before.get(cond.type) or {}
        since = old.get("lastTransitionTime") if old.get("status") == cond.status else None
        out.append(cond.model_copy(update={"last_transition_time": since or now}).to_wire())
    return out


def status(
    *,
    name: str,
    generation: int | None,
    invalid: str | None,
    blocked: tuple[str, str] | None,
    outcomes: Mapping[str, Outcome],
    ready_count: int,
    previous: Mapping,
    now: str,
) -> dict:
    """The whole status (a merge patch replaces its lists): computed from this round alone."""
    replicas = replica_entries(outcomes, previous.get("replicas") or [], now)
    conds = conditions(invalid=invalid, blocked=blocked, replicas=replicas, generation=generation)
    return {
        "observedGeneration": generation,
        "conditions": with_transition_times(conds, previous.get("conditions") or [], now),
        "replicas": [r.to_wire() for r in replicas],
        "loadedReplicas": sum(r.phase == LOADED for r in replicas),
        "readyReplicas": ready_count,
        "servedName": name,
    }


# -- deletion -------------------------------------------------------------------------------------------------
class Unload(Enum):
    DONE = "done"  # unloaded, or not loaded there
    RETRY = "retry"  # in use by unfinished requests (409), or the engine did not answer: try again later
    FAILED = "failed"  # refused otherwise: nothing to retry


def unload_outcome(code: int) -> Unload:
    if code in (200, 404):
        return Unload.DONE
    if code == 0 or code == 409 or code >= 500 or code == 429:
        return Unload.RETRY
    return Unload.FAILED
