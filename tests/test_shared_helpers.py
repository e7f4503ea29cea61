"""What two parts need, written once in the root distribution: the OpenAI error body, Kubernetes
quantities and human byte sizes, RFC 3339 times and the client-disconnect race (tests/test_layout.py fails
on a second copy of any of them)."""

from __future__ import annotations

import asyncio
import datetime as dt
from fractions import Fraction

import pytest
import yaml

from flotilla import manifest_yaml
from flotilla.disconnect import ClientDisconnected, until_disconnected
from flotilla.engine.server.errors import ApiError
from flotilla.gateway.errors import GatewayError
from flotilla.openai_errors import error_body, error_type
from flotilla.quantity import parse_byte_size, parse_quantity, quantity_bytes
from flotilla.timestamps import format_time, from_epoch, now, parse_time


# -- the OpenAI error body -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (
            404,
            "invalid_request_error",
        ),  # OpenAI: an unknown model is 404 invalid_request_error, model_not_found
        (405, "invalid_request_error"),
        (413, "invalid_request_error"),
        (429, "rate_limit_error"),
        (499, "invalid_request_error"),
        (500, "server_error"),
        (502, "server_error"),
        (503, "server_error"),
    ],
)
def test_the_engine_and_the_gateway_answer_one_error_body(status: int, kind: str) -> None:
    expected = {"error": {"message": "m", "type": kind, "param": "model", "code": "c"}}
    assert error_type(status) == kind and error_body(status, "m", "c", "model") == expected
    assert ApiError(status, "m", param="model", code="c").body() == expected
    assert GatewayError(status, "m", "c", param="model").body() == expected


# -- quantities and sizes --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", Fraction(1, 2)),
        ("1500m", Fraction(3, 2)),
        (2, Fraction(2)),
        ("16Gi", Fraction(16 * 2**30)),
        ("1.5Ki", Fraction(1536)),
        ("500M", Fraction(500 * 10**6)),
        ("1e3", Fraction(1000)),
        ("1E", Fraction(10**18)),  # E alone is exa; E3 an exponent
        ("100u", Fraction(1, 10**4)),
        (".5", Fraction(1, 2)),
    ],
)
def test_kubernetes_quantities_read_exactly(text: str | int, value: Fraction) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["lots", "1KiB", "2 Gi", "1.2.3", ""])
def test_what_is_not_a_quantity_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)


@pytest.mark.parametrize("text", ["500m", "-1Gi", "1u"])
def test_a_byte_quantity_is_whole_and_positive(text: str) -> None:
    with pytest.raises(ValueError, match="not a byte quantity"):
        quantity_bytes(text)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4GiB", 4 * 2**30),
        ("512MiB", 512 * 2**20),
        ("512mib", 512 * 2**20),
        ("4GB", 4 * 10**9),
        ("4g", 4 * 10**9),
        ("512M", 512 * 10**6),
        ("512mb", 512 * 10**6),
        ("4k", 4000),
        ("1e9", 10**9),
        ("1073741824", 2**30),
    ],
)
def test_human_byte_sizes(text: str, size: int) -> None:
    assert parse_byte_size(text) == size


def test_a_bare_m_is_refused_in_a_size_rather_than_read_as_mega_or_milli() -> None:
    with pytest.raises(ValueError, match="'m' is milli in a Kubernetes quantity; write 512M or 512MiB"):
        parse_byte_size("512m")
    with pytest.raises(ValueError, match="must be positive"):
        parse_byte_size("0")


# -- RFC 3339 --------------------------------------------------------------------------------------------
def test_rfc3339_times_in_utc() -> None:
    moment = dt.datetime(2030, 1, 2, 3, 4, 5, 250000, tzinfo=dt.timezone(dt.timedelta(hours=1)))
    assert format_time(moment) == "2030-01-02T02:04:05Z"
    assert format_time(moment, micro=True) == "2030-01-02T02:04:05.250000Z"
    assert from_epoch(moment.timestamp(), micro=True) == "2030-01-02T02:04:05.250000Z"
    assert parse_time("2030-01-02T02:04:05.250000Z") == moment
    assert parse_time("2030-01-02T02:04:05.25z") == moment
    assert parse_time("2030-01-02T02:04:05.25") == moment  # no offset: read as UTC
    assert abs(parse_time(now()).timestamp() - dt.datetime.now(dt.UTC).timestamp()) < 5
    with pytest.raises(ValueError):
        parse_time("yesterday")


# -- the client-disconnect race --------------------------------------------------------------------------
class Client:
    """An ASGI receive: the (already read) body, then a disconnect once `leave` is set."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()
        self.sent_body = False

    async def receive(self) -> dict:
        if not self.sent_body:
            self.sent_body = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}


def test_the_work_answers_while_the_client_stays() -> None:
    async def main() -> str:
        return await until_disconnected(asyncio.sleep(0.01, "done"), Client().receive)

    assert asyncio.run(main()) == "done"


def test_a_client_that_leaves_cancels_the_work_and_its_late_result_is_discarded() -> None:
    cancelled, discarded = asyncio.Event(), []

    async def work() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async def stubborn() -> str:  # done anyway when cancelled (as an upstream call that had opened)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return "opened"
        return "never"

    async def discard(result: str) -> None:
        discarded.append(result)

    async def main() -> None:
        client = Client()
        client.leave.set()
        with pytest.raises(ClientDisconnected):
            await until_disconnected(work(), client.receive)
        assert cancelled.is_set()
        client = Client()
        client.leave.set()
        with pytest.raises(ClientDisconnected):
            await until_disconnected(stubborn(), client.receive, discard)
        assert discarded == ["opened"]

    asyncio.run(main())


# -- YAML for Go readers ---------------------------------------------------------------------------------
# Each of these Go's YAML readers (kubectl, Helm, Prometheus) takes for a number when written plain.
READ_AS_NUMBERS_BY_GO = [
    "766e7",
    "1e3",
    "0o17",
    "0755",
    "1_000",
    "+Inf",
    "-.5",
    ".5",
    "0x1F",
    "12345",
    "0b101",
]


@pytest.mark.parametrize("value", READ_AS_NUMBERS_BY_GO)
def test_a_string_go_reads_as_a_number_is_quoted_and_reads_back_as_itself(value: str) -> None:
    text = manifest_yaml.dump({"metadata": {"labels": {"team": value}}})
    assert f"team: '{value}'" in text or f'team: "{value}"' in text
    assert yaml.safe_load(text) == {"metadata": {"labels": {"team": value}}}


@pytest.mark.parametrize("value", ["abc", "a1e3", "e7", "v1.2", "1.2.3", "sel-766e7", "t-0755"])
def test_a_string_no_reader_mistakes_stays_plain(value: str) -> None:
    assert manifest_yaml.dump({"k": value}) == f"k: {value}\n"


def test_numbers_stay_numbers_and_every_document_is_written() -> None:
    text = manifest_yaml.dump_all([{"replicas": 2, "ratio": 1e3}, {"name": "766e7"}])
    assert list(yaml.safe_load_all(text)) == [{"replicas": 2, "ratio": 1e3}, {"name": "766e7"}]
    assert "replicas: 2" in text
