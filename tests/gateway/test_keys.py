"""Tenants' API keys from key Secrets: lookup, rotation, malformed entries, the bearer header."""

from __future__ import annotations

import base64
from typing import Any

from flotilla.contract import API_KEY_SECRET_LABEL, api_key_digest
from flotilla.gateway.core.keys import KeyRing, parse_bearer


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def secret(name: str, tenant: str | None, data: dict[str, str] | None = None, **extra: Any) -> dict:
    labels = {API_KEY_SECRET_LABEL: tenant} if tenant is not None else {}
    return {"metadata": {"name": name, "labels": labels}, "data": data or {}, **extra}


def test_tenant_of_a_key() -> None:
    ring = KeyRing.from_secrets(
        [
            secret(
                "keys-a", "a", {"ci": b64(api_key_digest("sk-a-ci")), "laptop": b64(api_key_digest("sk-a-2"))}
            ),
            secret("keys-b", "b", {"prod": b64(api_key_digest("sk-b"))}),
        ]
    )
    assert (ring.tenant_of("sk-a-ci"), ring.tenant_of("sk-a-2"), ring.tenant_of("sk-b")) == ("a", "a", "b")
    assert ring.tenant_of("sk-nope") is None
    assert ring.tenant_of("") is None and ring.tenant_of(None) is None
    assert len(ring) == 3 and ring.problems == ()


def test_rotation_rejects_the_old_key() -> None:
    before = KeyRing.from_secrets([secret("keys-a", "a", {"ci": b64(api_key_digest("old"))})])
    after = KeyRing.from_secrets([secret("keys-a", "a", {"ci": b64(api_key_digest("new"))})])
    assert before.tenant_of("old") == "a" and before.tenant_of("new") is None
    assert after.tenant_of("old") is None and after.tenant_of("new") == "a"


def test_plain_and_string_data_digests_are_accepted() -> None:
    digest = api_key_digest("k1")
    ring = KeyRing.from_secrets(
        [
            secret("plain", "a", {"decoded": digest.upper()}),  # already decoded, any case
            secret("manifest", "b", stringData={"k2": api_key_digest("k2") + "\n"}),
        ]
    )
    assert ring.tenant_of("k1") == "a" and ring.tenant_of("k2") == "b"
    assert ring.problems == ()


def test_malformed_entries_are_skipped_and_reported_without_values() -> None:
    good = api_key_digest("good")
    ring = KeyRing.from_secrets(
        [
            secret(
                "keys-a",
                "a",
                {"short": b64("abc123"), "not-base64": "%%%", "raw-key": b64("sk-live-raw"), "ok": b64(good)},
            ),
            secret("unlabelled", None, {"x": b64(api_key_digest("x"))}),
            secret("empty-tenant", "", {"y": b64(api_key_digest("y"))}),
        ]
    )
    assert ring.tenant_of("good") == "a"
    assert ring.tenant_of("x") is None and ring.tenant_of("y") is None
    problems = "\n".join(ring.problems)
    for entry in ("keys-a, entry short", "keys-a, entry not-base64", "keys-a, entry raw-key", "unlabelled"):
        assert entry in problems
    assert "empty-tenant" in problems
    for value in ("abc123", "%%%", "sk-live-raw", b64("sk-live-raw"), good):
        assert value not in problems


def test_a_key_listed_for_two_tenants_is_refused_for_both() -> None:
    digest = b64(api_key_digest("shared"))
    ring = KeyRing.from_secrets(
        [
            secret("keys-a", "a", {"k": digest}),
            secret("keys-b", "b", {"k": digest, "own": b64(api_key_digest("b"))}),
        ]
    )
    assert ring.tenant_of("shared") is None and ring.tenant_of("b") == "b"
    assert any("keys-a/k" in p and "keys-b/k" in p for p in ring.problems)


def test_parse_bearer() -> None:
    assert parse_bearer("Bearer sk-123") == "sk-123"
    assert parse_bearer("bearer   sk-123  ") == "sk-123"
    assert parse_bearer("Basic dXNlcjpwYXNz") is None
    assert parse_bearer("Bearer") is None and parse_bearer("Bearer   ") is None
    assert parse_bearer("") is None and parse_bearer(None) is None
