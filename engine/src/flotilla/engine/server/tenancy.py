"""Who a request is served for: its tenant, the unit of the fair policy and of the per-tenant metrics.

A request may name its tenant in HEADER_TENANT only when it also carries the gateway's credential in
HEADER_GATEWAY_TOKEN: the gateway, which authenticates clients and knows their tenant, adds it (Envoy's
route, or the relay), and the engine holds only its SHA-256. A client that reaches the engine directly has
neither the credential nor any way to learn it (the picker's answers never carry it), so it cannot pass
itself off as another tenant (403). The operator's internal token (HEADER_INTERNAL_TOKEN) is for adapter
loads only: it names no tenant. A request that names none is served for the engine's own tenant
(ENV_TENANT, "" when unset). The credential is checked before the name, so a caller without it learns
nothing about what names would pass.
"""

from __future__ import annotations

import hmac
import re

from starlette.datastructures import Headers

from flotilla.contract import HEADER_GATEWAY_TOKEN, HEADER_INTERNAL_TOKEN, HEADER_TENANT, token_matches
from flotilla.engine.server.errors import ApiError

MAX_TENANT_LENGTH = 63
TENANT_RULE = (
    f"at most {MAX_TENANT_LENGTH} characters: lowercase letters, digits, '-' and '.', starting and ending "
    "with a letter or digit (a Kubernetes name)"
)
_TENANT = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


def valid_tenant(name: str) -> bool:
    return len(name) <= MAX_TENANT_LENGTH and _TENANT.fullmatch(name) is not None


def request_tenant(headers: Headers, own_tenant: str, gateway_token_sha256: str | None) -> str:
    """The request's tenant, or an ApiError: 403 when it names one without the gateway's credential, 400
    when the name is not a tenant name or is named more than once (a gateway that appends its header to a
    client's must not let the client's win)."""
    names = headers.getlist(HEADER_TENANT)
    if not names:
        return own_tenant
    given = headers.getlist(HEADER_GATEWAY_TOKEN)
    if not gateway_token_sha256:
        why = "this engine trusts no gateway, so no request may name its tenant"
    elif not given:
        why = f"the request has no {HEADER_GATEWAY_TOKEN}"
    elif len(given) > 1 or not token_matches(given[0], gateway_token_sha256):
        why = f"the request's {HEADER_GATEWAY_TOKEN} is not the gateway's"
    else:
        why = None
    if why is not None:
        raise ApiError(
            403,
            f"{HEADER_TENANT} is accepted only with the gateway's {HEADER_GATEWAY_TOKEN}: {why}",
            code="tenant_not_allowed",
        )
    if len(names) > 1:
        raise ApiError(
            400,
            f"{HEADER_TENANT} appears {len(names)} times; a request has one tenant",
            code="invalid_tenant",
        )
    named = names[0]
    if not valid_tenant(named):
        shown = named if len(named) <= 2 * MAX_TENANT_LENGTH else named[: 2 * MAX_TENANT_LENGTH] + "..."
        raise ApiError(
            400,
            f"{HEADER_TENANT} {shown!r} ({len(named)} characters) is not a tenant name: {TENANT_RULE}",
            code="invalid_tenant",
        )
    return named


def require_internal_token(headers: Headers, internal_token: str | None, what: str) -> None:
    """A 403 unless the request carries the engine's internal token, where the engine has one: for what
    only the fleet may do (loading and unloading LoRA adapters: the operator holds the token). An engine
    without one (a developer's) leaves it to --api-key."""
    if not internal_token:
        return
    given = headers.get(HEADER_INTERNAL_TOKEN)
    if given is None or not hmac.compare_digest(given.encode(), internal_token.encode()):
        raise ApiError(
            403,
            f"{what} needs this engine's {HEADER_INTERNAL_TOKEN} (the operator's); the request "
            f"{'has none' if given is None else 'has another'}",
            code="internal_token_required",
        )
