"""Tenants' API keys: which tenant a presented key belongs to, from the key Secrets.

Each Secret in the gateway's namespace labelled API_KEY_SECRET_LABEL=<tenant> holds one entry per key:
the entry's name names the key, its value is api_key_digest(key), 64 hex characters (base64 in `data`, as
the API returns it; plain in `stringData`, as a manifest may write it). The gateway never sees a key
itself until a client presents one. Rotating a key is editing the Secret: the gateway rebuilds its ring
from the Secrets it watches, and a key whose digest is gone stops working with the next request.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flotilla.contract import API_KEY_SECRET_LABEL, api_key_digest

_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True)
class KeyRing:
    """digest -> tenant, and what was wrong with the Secrets it came from (each problem names a Secret and
    an entry, never a value or a digest)."""

    tenants_by_digest: Mapping[str, str] = field(default_factory=dict)
    problems: tuple[str, ...] = ()

    @classmethod
    def from_secrets(cls, secrets: Iterable[dict[str, Any]]) -> KeyRing:
        found: dict[str, set[str]] = {}  # digest -> tenants
        where: dict[str, list[str]] = {}  # digest -> "secret/entry" it appears as
        problems: list[str] = []
        for secret in secrets:
            meta = secret.get("metadata") or {}
            name = meta.get("name") or "?"
            tenant = (meta.get("labels") or {}).get(API_KEY_SECRET_LABEL)
            if not tenant:
                problems.append(f"secret {name}: no tenant in its label {API_KEY_SECRET_LABEL}; skipped")
                continue
            for entry, digest in _entries(secret):
                if digest is None:
                    problems.append(
                        f"secret {name}, entry {entry}: not the 64-hex-character SHA-256 of a key; skipped"
                    )
                    continue
                found.setdefault(digest, set()).add(tenant)
                where.setdefault(digest, []).append(f"{name}/{entry}")
        ring: dict[str, str] = {}
        for digest, tenants in found.items():
            if len(tenants) > 1:
                # One key for two tenants: which tenant a request is for cannot be told, so neither gets it.
                problems.append(
                    "one key is listed for several tenants, so it is refused for all: "
                    + ", ".join(sorted(where[digest]))
                )
            else:
                ring[digest] = next(iter(tenants))
        return cls(tenants_by_digest=ring, problems=tuple(problems))

    def __len__(self) -> int:
        return len(self.tenants_by_digest)

    def tenant_of(self, api_key: str | None) -> str | None:
        """The tenant of `api_key`, or None for no key or an unknown one.

        A dict lookup on the presented key's digest, not a constant-time compare: what a lookup's timing
        could reveal is how the presented key's SHA-256 relates to stored digests, and learning digest bits
        does not help find a key (SHA-256 is preimage-resistant, and keys are random)."""
        if not api_key:
            return None
        return self.tenants_by_digest.get(api_key_digest(api_key))


def _entries(secret: dict[str, Any]) -> Iterable[tuple[str, str | None]]:
    """(entry, lower-case hex digest or None when malformed) for each entry of `data` and `stringData`."""
    for entry, value in sorted((secret.get("data") or {}).items()):
        yield entry, _from_data(value)
    for entry, value in sorted((secret.get("stringData") or {}).items()):
        yield entry, _hex(value)


def _from_data(value: object) -> str | None:
    """A `data` value is base64 of the hex digest. One already decoded (a plain hex digest, as some
    tools hand Secrets over) is accepted too: 64 hex characters decode to 48 bytes, never to a digest, so
    the two readings cannot be confused."""
    if not isinstance(value, str):
        return None
    try:
        decoded = base64.b64decode(value, validate=True).decode("ascii")
    except (binascii.Error, UnicodeDecodeError):
        decoded = ""
    return _hex(decoded) or _hex(value)


def _hex(value: object) -> str | None:
    if isinstance(value, str) and _HEX_DIGEST.fullmatch(value.strip()):
        return value.strip().lower()
    return None


def parse_bearer(header: str | None) -> str | None:
    """The token of an 'Authorization: Bearer <token>' header (the scheme in any case), else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
