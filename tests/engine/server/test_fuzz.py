"""Schemathesis fuzzes every operation of the server's own OpenAPI schema, with valid and invalid
inputs. No 5xx may come back (there is no injected fault here), and every error is OpenAI-shaped."""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

# Per operation and mode: enough to hit every field, short enough for 2 busy cores. Raise it for a
# longer hunt: FLOTILLA_FUZZ_EXAMPLES=500.
EXAMPLES = int(os.environ.get("FLOTILLA_FUZZ_EXAMPLES", "25"))


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_no_server_errors_from_fuzzed_requests(server, mode):
    raw = httpx.get(f"{server.url}/openapi.json", trust_env=False).json()
    schema = schemathesis.openapi.from_dict(raw)
    # An Err has no ok(): loading a broken operation fails the test here, as it should.
    operations = [result.ok() for result in schema.get_all_operations()]  # pyright: ignore[reportAttributeAccessIssue]
    assert {op.path for op in operations} >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
    }
    failures = []
    if mode == GenerationMode.NEGATIVE:  # operations without inputs have no invalid form
        operations = [op for op in operations if op.method.upper() == "POST"]
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        def fuzz(case):
            response = case.call(base_url=server.url, timeout=60)
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:300]}"
                )
            elif response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, response.text

        fuzz()
    assert not failures, "\n".join(failures[:5])
