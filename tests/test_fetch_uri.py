"""flotilla.fetch_uri, the one parser of hf:// and http(s) archive URIs (its parsing is tested with `flotilla
model fetch` in tests/engine/model/test_model_fetch.py): URIs made safe to print."""

from __future__ import annotations

import pytest

from flotilla.fetch_uri import redact_uri


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("https://host/a.tar.gz?X-Amz-Signature=secret", "https://host/a.tar.gz?…"),
        ("https://user:secret@host/a.tar.gz", "https://user:***@host/a.tar.gz"),
        (f"https://host/a.tgz?sig=secret#sha256={'ab' * 32}", f"https://host/a.tgz?…#sha256={'ab' * 32}"),
        ("https://host/a.tar.gz", "https://host/a.tar.gz"),
        ("hf://org/name@v1", "hf://org/name@v1"),
        ("file:relative/sql", "file:relative/sql"),  # nothing to hide: as written, not rewritten
        ("/adapters/sql", "/adapters/sql"),
    ],
)
def test_redact_uri_masks_a_password_and_a_query_and_leaves_the_rest_as_written(uri: str, shown: str) -> None:
    assert redact_uri(uri) == shown
