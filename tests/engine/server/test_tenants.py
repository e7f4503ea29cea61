"""The tenant of a request: named by the gateway in HEADER_TENANT with the gateway's credential (the
engine holds its SHA-256), else the engine's own; refused (403/400) otherwise, holding nothing; counted per tenant in /metrics under a
bounded number of labels; and the scheduling flags that go with it."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flotilla.contract import (
    ENV_GATEWAY_TOKEN_SHA256,
    ENV_INTERNAL_TOKEN,
    ENV_TENANT,
    FLAG_SCHEDULING_POLICY,
    FLAG_TENANT_WEIGHTS,
    HEADER_GATEWAY_TOKEN,
    HEADER_INTERNAL_TOKEN,
    HEADER_TENANT,
    LABEL_TENANT,
    NUM_REQUESTS_WAITING,
    OTHER_TENANT,
    PROMPT_TOKENS,
    TENANT_GENERATION_TOKENS,
    TENANT_NUM_REQUESTS_WAITING,
    TENANT_PROMPT_TOKENS,
    TENANT_TIME_TO_FIRST_TOKEN,
    TENANT_VIRTUAL_TOKEN_COUNTER,
    counter_total,
    token_digest,
)

MODEL = "tiny"
TOKEN = "gateway-secret"
DIGEST = token_digest(TOKEN)  # what the engine holds
PROMPT = "count me in"
TTFT_COUNT = TENANT_TIME_TO_FIRST_TOKEN + "_count"


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def by_tenant(metrics: dict, name: str) -> dict[str, float]:
    """The samples of `name`, keyed by their tenant label (each must appear once)."""
    out: dict[str, float] = {}
    for labels, value in metrics.get(name, []):
        assert labels[LABEL_TENANT] not in out, (name, labels)
        out[labels[LABEL_TENANT]] = value
    return out


def as_tenant(tenant: str, token: str | None = TOKEN) -> dict[str, str]:
    return {HEADER_TENANT: tenant} | ({HEADER_GATEWAY_TOKEN: token} if token is not None else {})


def completion(client: httpx.Client, headers: dict | None = None, max_tokens: int = 2, **body):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True} | body
    return client.post("/v1/completions", json=body, headers=headers or {})


def chat(client: httpx.Client, headers: dict | None = None, max_tokens: int = 2, stream: bool = False):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if not stream:
        return client.post("/v1/chat/completions", json=body, headers=headers or {})
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers or {}) as resp:
        resp.read()
        return resp


def stream_completion(client: httpx.Client, headers: dict, max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        resp.read()
        return resp


def assert_error(resp: httpx.Response, status: int, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error
    return error


@pytest.fixture
def client_of():
    clients: list[httpx.Client] = []

    def make(server) -> httpx.Client:
        clients.append(httpx.Client(base_url=server.url, trust_env=False, timeout=60))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


# -- who a request is served for ---------------------------------------------------------------------------
def test_named_tenant_is_counted_under_it_and_unnamed_under_the_engines(make_server, monkeypatch, client_of):
    monkeypatch.setenv(ENV_TENANT, "pod-team")
    server = make_server(gateway_token_sha256=DIGEST)
    http = client_of(server)
    n = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]

    assert completion(http, as_tenant("team-a"), max_tokens=3).status_code == 200
    assert stream_completion(http, as_tenant("team-a"), max_tokens=2).status_code == 200
    assert chat(http, as_tenant("team-b"), max_tokens=4, stream=True).status_code == 200
    assert chat(http, as_tenant("team-b"), max_tokens=1).status_code == 200
    assert completion(http, max_tokens=5).status_code == 200  # names no tenant: the engine's own
    server.assert_no_leak()

    metrics = scrape(server.url)
    generated = by_tenant(metrics, counter_total(TENANT_GENERATION_TOKENS))
    assert generated == {"team-a": 3 + 2, "team-b": 4 + 1, "pod-team": 5}
    prompts = by_tenant(metrics, counter_total(TENANT_PROMPT_TOKENS))
    assert (prompts["team-a"], prompts["pod-team"]) == (2 * n, n)
    assert prompts["team-b"] > 0  # the chat template's tokens
    assert by_tenant(metrics, TTFT_COUNT) == {"team-a": 2, "team-b": 2, "pod-team": 1}
    assert by_tenant(metrics, TENANT_NUM_REQUESTS_WAITING) == {"team-a": 0, "team-b": 0, "pod-team": 0}
    counters = by_tenant(metrics, TENANT_VIRTUAL_TOKEN_COUNTER)
    assert set(counters) == {"team-a", "team-b", "pod-team"} and all(v > 0 for v in counters.values())
    # The per-tenant series carry the engine's other labels; the engine-wide ones keep the pod's tenant.
    for labels, _ in metrics[counter_total(TENANT_PROMPT_TOKENS)]:
        assert labels["model"] == MODEL
    assert {labels[LABEL_TENANT] for labels, _ in metrics[counter_total(PROMPT_TOKENS)]} == {"pod-team"}
    # The scheduler saw the same tenants (the fair policy's unit).
    assert set(server.llm.scheduler.ledger.tenants) == {"team-a", "team-b", "pod-team"}


def test_without_an_engine_tenant_unnamed_requests_are_the_empty_tenant(make_server, monkeypatch, client_of):
    monkeypatch.delenv(ENV_TENANT, raising=False)
    server = make_server()
    assert completion(client_of(server), max_tokens=2).status_code == 200
    assert set(server.llm.scheduler.ledger.tenants) == {""}
    assert by_tenant(scrape(server.url), counter_total(TENANT_GENERATION_TOKENS)) == {"": 2}


# -- refused tenants hold nothing ----------------------------------------------------------------------------
def assert_nothing_held(server, http: httpx.Client, refused: set[str]) -> None:
    server.assert_no_leak()
    assert server.state.in_flight == 0
    metrics = scrape(server.url)
    assert sum(v for _, v in metrics[NUM_REQUESTS_WAITING]) == 0
    assert all(v == 0 for _, v in metrics.get(TENANT_NUM_REQUESTS_WAITING, []))
    assert not refused & set(by_tenant(metrics, counter_total(TENANT_PROMPT_TOKENS)))
    assert not refused & set(server.llm.scheduler.ledger.tenants)
    assert completion(http, as_tenant("good-one")).status_code == 200
    server.assert_no_leak()


@pytest.mark.parametrize(
    ("token", "why"),
    [
        (None, f"the request has no {HEADER_GATEWAY_TOKEN}"),
        ("wrong", "is not the gateway's"),
        (DIGEST, "is not the gateway's"),  # the digest a tenant can read in the pod's spec is no credential
    ],
    ids=["no-token", "wrong-token", "the-digest-itself"],
)
def test_tenant_without_the_gateways_credential_is_403(make_server, client_of, token, why):
    server = make_server(gateway_token_sha256=DIGEST)
    http = client_of(server)
    for resp in (
        completion(http, as_tenant("team-x", token)),
        completion(http, as_tenant("team-x", token), stream=True),
        chat(http, as_tenant("team-x", token)),
        chat(http, as_tenant("team-x", token), stream=True),
    ):
        error = assert_error(resp, 403, HEADER_TENANT, HEADER_GATEWAY_TOKEN, "gateway", why)
        assert error["type"] == "permission_error" and error["code"] == "tenant_not_allowed"
    # The token is checked before the name: a bad name without the token learns nothing more.
    assert_error(completion(http, as_tenant("Not_A_Name", token)), 403, HEADER_TENANT)
    assert_nothing_held(server, http, {"team-x"})


def test_the_operators_token_names_no_tenant(make_server, client_of):
    """The operator's internal token (adapter loads) is not the gateway's credential: with it alone, as
    with nothing, a request may not name its tenant."""
    server = make_server(gateway_token_sha256=DIGEST, internal_token="operator-secret")
    http = client_of(server)
    resp = completion(http, {HEADER_TENANT: "team-x", HEADER_INTERNAL_TOKEN: "operator-secret"})
    assert_error(resp, 403, HEADER_TENANT, f"the request has no {HEADER_GATEWAY_TOKEN}")
    twice = [(HEADER_TENANT, "team-x"), (HEADER_GATEWAY_TOKEN, "wrong"), (HEADER_GATEWAY_TOKEN, TOKEN)]
    assert_error(completion(http, twice), 403, HEADER_TENANT)  # one credential, not a guess beside it
    assert_nothing_held(server, http, {"team-x"})


def test_no_tenant_may_be_named_when_the_engine_trusts_no_gateway(make_server, client_of):
    server = make_server(internal_token=TOKEN)
    http = client_of(server)
    for token in (TOKEN, ""):
        resp = completion(http, as_tenant("team-x", token))
        assert_error(resp, 403, HEADER_TENANT, "this engine trusts no gateway")
    assert completion(http).status_code == 200  # naming none is fine
    server.assert_no_leak()
    assert "team-x" not in server.llm.scheduler.ledger.tenants


@pytest.mark.parametrize(
    "name",
    ["Team-A", "team_a", "-team", "team-", "team a", "", "a" * 64, "team/a"],
    ids=["upper", "underscore", "leading-dash", "trailing-dash", "space", "empty", "64-chars", "slash"],
)
def test_ill_formed_tenant_is_400_naming_the_value_and_the_rule(make_server, client_of, name):
    server = make_server(gateway_token_sha256=DIGEST)
    http = client_of(server)
    for resp in (completion(http, as_tenant(name)), chat(http, as_tenant(name), stream=True)):
        error = assert_error(resp, 400, HEADER_TENANT, repr(name), "at most 63 characters", "Kubernetes name")
        assert error["code"] == "invalid_tenant"
    assert_nothing_held(server, http, {name})


def test_a_63_character_tenant_is_fine_and_a_repeated_header_is_400(make_server, client_of):
    server = make_server(gateway_token_sha256=DIGEST)
    http = client_of(server)
    longest = "a" + "b.c-" * 15 + "dz"
    assert len(longest) == 63
    assert completion(http, as_tenant(longest)).status_code == 200
    twice = [(HEADER_TENANT, "team-a"), (HEADER_TENANT, "team-b"), (HEADER_GATEWAY_TOKEN, TOKEN)]
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT}, headers=twice)
    assert_error(resp, 400, HEADER_TENANT, "2 times")
    assert_nothing_held(server, http, {"team-a", "team-b"})


# -- bounded label cardinality -------------------------------------------------------------------------------
def test_tenants_beyond_the_cap_are_reported_as_other(make_server, monkeypatch, client_of):
    monkeypatch.delenv(ENV_TENANT, raising=False)
    cap = 3
    server = make_server(gateway_token_sha256=DIGEST, max_tenant_labels=cap)
    http = client_of(server)
    n = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    tenants = [f"t{i}" for i in range(cap + 3)]
    for i, tenant in enumerate(tenants):  # one at a time: the first `cap` to arrive keep their names
        assert completion(http, as_tenant(tenant), max_tokens=i + 1).status_code == 200
    assert completion(http, as_tenant(OTHER_TENANT), max_tokens=10).status_code == 200  # no slot taken
    assert completion(http, as_tenant("t0"), max_tokens=1).status_code == 200  # still its own label
    server.assert_no_leak()

    metrics = scrape(server.url)
    named = {*tenants[:cap], OTHER_TENANT}
    for name in (
        counter_total(TENANT_PROMPT_TOKENS),
        counter_total(TENANT_GENERATION_TOKENS),
        TENANT_VIRTUAL_TOKEN_COUNTER,
        TENANT_NUM_REQUESTS_WAITING,
        TTFT_COUNT,
    ):
        assert set(by_tenant(metrics, name)) == named, name
        assert len(by_tenant(metrics, name)) == cap + 1
    generated = by_tenant(metrics, counter_total(TENANT_GENERATION_TOKENS))
    assert generated == {"t0": 1 + 1, "t1": 2, "t2": 3, OTHER_TENANT: 4 + 5 + 6 + 10}
    assert by_tenant(metrics, counter_total(TENANT_PROMPT_TOKENS))[OTHER_TENANT] == 4 * n
    assert by_tenant(metrics, TTFT_COUNT) == {"t0": 2, "t1": 1, "t2": 1, OTHER_TENANT: 4}
    # "other" reports the largest virtual counter of its tenants.
    ledger = server.llm.scheduler.ledger
    overflow = [*tenants[cap:], OTHER_TENANT]
    assert by_tenant(metrics, TENANT_VIRTUAL_TOKEN_COUNTER)[OTHER_TENANT] == pytest.approx(
        max(ledger.counter(t) for t in overflow)
    )
    # A later tenant lands under "other" too: the labels stay as they were.
    assert completion(http, as_tenant("late"), max_tokens=1).status_code == 200
    assert set(by_tenant(scrape(server.url), TTFT_COUNT)) == named


def test_tenant_labels_unit():
    from flotilla.engine.server.metrics import TenantLabels

    label = TenantLabels(2)
    assert [label(t) for t in ("a", OTHER_TENANT, "b", "c", "a", "b", "c")] == [
        "a", OTHER_TENANT, "b", OTHER_TENANT, "a", "b", OTHER_TENANT,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="1 or more"):
        TenantLabels(0)


# -- the flags -----------------------------------------------------------------------------------------------
def serve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "engine", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            [FLAG_SCHEDULING_POLICY, "lottery"],
            f"argument {FLAG_SCHEDULING_POLICY}: invalid choice: 'lottery'",
        ),
        (
            [FLAG_TENANT_WEIGHTS, "team-a=2,team-b=0"],
            f"argument {FLAG_TENANT_WEIGHTS}: 'team-b=0' is not tenant=weight with a positive weight",
        ),
        ([FLAG_TENANT_WEIGHTS, "team-a"], f"argument {FLAG_TENANT_WEIGHTS}: 'team-a' is not tenant=weight"),
    ],
    ids=["policy", "zero-weight", "no-weight"],
)
def test_bad_scheduling_flags_exit_2_before_listening(tiny_model, flags, words):
    proc = serve("--model", str(tiny_model), *flags)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and words in errors[0], proc.stderr
    assert "Uvicorn running" not in proc.stderr


def test_scheduling_flags_and_internal_token_parse(monkeypatch):
    from flotilla.cli import build_parser
    from flotilla.engine.engine_args import engine_config_from_args

    monkeypatch.setenv(ENV_INTERNAL_TOKEN, "from-env")
    monkeypatch.setenv(ENV_GATEWAY_TOKEN_SHA256, DIGEST)
    args = build_parser().parse_args(
        ["engine", "serve", "--model", "m", FLAG_SCHEDULING_POLICY, "fair", FLAG_TENANT_WEIGHTS, "a=2,b=1"]
    )
    config = engine_config_from_args(args)
    assert (config.scheduling_policy, config.tenant_weights) == ("fair", {"a": 2.0, "b": 1.0})
    assert args.internal_token == "from-env" and args.gateway_token_sha256 == DIGEST
    args = build_parser().parse_args(["engine", "serve", "--model", "m", "--internal-token", "flag"])
    assert args.internal_token == "flag" and engine_config_from_args(args).scheduling_policy == "fcfs"
    monkeypatch.delenv(ENV_INTERNAL_TOKEN)
    assert build_parser().parse_args(["engine", "serve", "--model", "m"]).internal_token is None
