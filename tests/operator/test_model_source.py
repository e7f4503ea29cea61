from __future__ import annotations

import pytest

from flotilla import fetch_uri
from flotilla.fetch_uri import FetchError, parse_fetch_uri, redact_uri
from flotilla.operator.desired import model_source
from flotilla.operator.desired.model_source import ModelUri, ModelUriError, parse_claim_uri, parse_model_uri


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


# -- one parser of hf:// and http(s):// URIs (flotilla.fetch_uri), for the operator and the engine ----------
SHA = "ab" * 32
FETCH_SAMPLES = [
    "hf://org/name",
    "hf://org/name@v1.0",
    "hf://org/name@",
    "hf://justname",
    "hf://a/b/c",
    "hf://org/na me",
    "hf://-org/name",
    "https://host/model.tar.gz",
    "http://host:8080/model.tgz",
    "https://host/model.TAR",
    f"https://host/model.tar.gz#sha256={SHA}",
    "https://host/model.tar.gz#md5=00",
    "https://host/model.tar.gz?X-Amz-Signature=secret",
    "https://user:pw@host/model.tar.gz",
    "https://host/model.zip",
    "https:///model.tar.gz",
    "https://host:99999/model.tar.gz",
    "http://[::1/model.tar.gz",
]


def _accepts(parse, uri: str) -> bool:
    try:
        parse(uri)
    except (ValueError, FetchError):
        return False
    return True


@pytest.mark.parametrize("uri", FETCH_SAMPLES)
def test_the_operator_accepts_exactly_the_hf_and_http_uris_the_engines_fetch_does(uri: str) -> None:
    """A model uri the webhook accepts is one the init container's `flotilla model fetch` can fetch, and the
    other way round: one parser (flotilla.fetch_uri), so no second copy can drift from it."""
    assert _accepts(parse_model_uri, uri) == _accepts(parse_fetch_uri, uri)


def test_model_source_parses_hf_and_http_with_fetch_uri_itself(monkeypatch) -> None:
    """Not a copy that happens to agree today: model_source calls flotilla.fetch_uri's parser."""
    assert model_source.parse_fetch_uri is fetch_uri.parse_fetch_uri

    def refuse(uri: str):
        raise FetchError("refused by the one parser", exit_code=2)

    monkeypatch.setattr(model_source, "parse_fetch_uri", refuse)
    for uri in ("hf://org/name", "https://host/model.tar.gz"):
        with pytest.raises(ModelUriError, match="refused by the one parser"):
            parse_model_uri(uri)


def test_hub_and_archive_uris_keep_what_the_init_container_fetches() -> None:
    assert parse_model_uri("hf://org/name@v1") == ModelUri("hf", "org/name@v1")
    uri = f"https://host/model.tar.gz#sha256={SHA}"
    assert parse_model_uri(uri) == ModelUri("https", uri)  # the checksum goes to `flotilla model fetch`


@pytest.mark.parametrize(
    ("uri", "words"),
    [
        ("https://user:hunter2@host/model.tar.gz", "credentials in the URL are not supported"),
        ("https://host/model.zip?sig=secret", "must name a .tar.gz, .tgz or .tar archive"),
        ("hf://org/name@", "empty revision"),
    ],
)
def test_a_refused_hub_or_archive_uri_names_the_value_without_secrets_and_why(uri: str, words: str) -> None:
    with pytest.raises(ModelUriError) as refused:
        parse_model_uri(uri)
    message = str(refused.value)
    assert words in message and "hunter2" not in message and "secret" not in message
    assert message.startswith(f"{redact_uri(uri)!r}: ")


@pytest.mark.parametrize(
    ("uri", "words"),
    [
        ("pvc://claim/../other", "leaves the claim"),
        ("pvc://Claim_1/x", "not a PersistentVolumeClaim name"),
        ("pvc://claim/", "claim and a path"),
        ("pvc://claim/a/..", "claim and a path"),
    ],
)
def test_a_pvc_uri_names_a_claim_and_a_folder_inside_it(uri: str, words: str) -> None:
    with pytest.raises(ModelUriError, match=words):
        parse_model_uri(uri)
    assert parse_claim_uri("pvc://claim/a/./b/") == ("claim", "a/b")
