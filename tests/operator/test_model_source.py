from __future__ import annotations

import pytest

from flotilla.operator.desired.model_source import ModelUri, ModelUriError, parse_model_uri


@pytest.mark.parametrize(
    ("uri", "parsed"),
    [
        ("file:///models/tiny", ModelUri("file", "/models/tiny")),
        ("file:///models/tiny/", ModelUri("file", "/models/tiny")),
        ("pvc://claim/a/b", ModelUri("pvc", "claim", "a/b")),
        ("hf://org/name", ModelUri("hf", "org/name")),
    ],
)
def test_good_uris(uri, parsed):
    assert parse_model_uri(uri) == parsed


@pytest.mark.parametrize(
    ("uri", "words"),
    [
        ("s3://bucket/model", "unsupported uri scheme 's3'"),
        ("/models/tiny", "no scheme"),
        ("file://host/models", "absolute path"),
        ("file:///", "model folder"),
        ("pvc://claim", "claim and a path"),
        ("hf://justname", "one repository"),
        ("hf://a/b/c", "one repository"),
    ],
)
def test_bad_uris_say_why(uri, words):
    with pytest.raises(ModelUriError, match=words):
        parse_model_uri(uri)
