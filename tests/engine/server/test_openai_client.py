"""The official openai client against the real server: sync and async, streaming and not."""

from __future__ import annotations

import asyncio

import openai
import pytest

MODEL = "tiny"


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def prompt_len(http, text: str) -> int:
    return http.post("/tokenize", json={"prompt": text}).json()["count"]


def test_models_lists_the_served_name(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == server.llm.max_model_len


def test_completion_usage_counts_tokens(client, http):
    resp = client.completions.create(model=MODEL, prompt="hello there", max_tokens=7,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    choice = resp.choices[0]
    assert resp.object == "text_completion" and resp.model == MODEL
    assert choice.finish_reason == "length" and choice.text
    assert resp.usage.prompt_tokens == prompt_len(http, "hello there")
    assert resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7


def test_completion_stream_matches_non_stream(client):
    args = dict(model=MODEL, prompt="the café", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_uses_template_and_counts_usage(client, http):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].finish_reason == "length"
    templated = http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert resp.usage.prompt_tokens == templated > prompt_len(http, "be brief hi")
    assert resp.usage.completion_tokens == 5


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "tell me"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 6


def test_async_client_many_concurrent_streams(server):
    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as aclient:

            async def one(i: int) -> str:
                stream = await aclient.completions.create(
                    model=MODEL,
                    prompt=f"request {i}",
                    max_tokens=16,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
                return reasons[-1]

            async def plain() -> str:
                resp = await aclient.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4
                )
                return resp.choices[0].finish_reason

            return await asyncio.gather(*(one(i) for i in range(12)), plain())

    reasons = asyncio.run(run())
    assert reasons[:12] == ["length"] * 12
    assert reasons[12] in ("length", "stop")


def test_n_and_prompt_lists_give_one_choice_each(client):
    resp = client.completions.create(model=MODEL, prompt=["one", "two"], n=2, max_tokens=3, seed=1,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert resp.usage.completion_tokens == 12


def test_token_id_prompt_and_seed_reproducible(client):
    args = dict(model=MODEL, prompt=[1, 300, 301, 302], max_tokens=8, seed=42, temperature=1.0)
    assert (
        client.completions.create(**args).choices[0].text == client.completions.create(**args).choices[0].text
    )


def test_completion_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, logprobs=2,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=3,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    content = resp.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)


def test_stop_string_is_honoured(client):
    first = client.completions.create(model=MODEL, prompt="stop test", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
    stop = first[4:7]
    resp = client.completions.create(model=MODEL, prompt="stop test", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == first[: first.index(stop)]


def test_tokenize_detokenize_round_trip(http):
    tokens = http.post("/tokenize", json={"prompt": "round trip ü", "add_special_tokens": False}).json()[
        "tokens"
    ]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "round trip ü"


def test_a_speculating_server_streams_what_a_plain_one_answers(client, make_server, tiny_model):
    """Greedy, with the model drafting for itself: steps deliver several tokens each, and the stream's
    text and usage are the plain server's."""
    args = dict(model=MODEL, prompt="the café", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**args).choices[0].text
    engine = {
        "speculative_method": "draft",
        "speculative_model": str(tiny_model),
        "num_speculative_tokens": 4,
    }
    spec_server = make_server(engine)
    with openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", max_retries=0) as spec_client:
        stream = spec_client.completions.create(
            model=MODEL,
            prompt="the café",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain
    assert chunks[-1].usage.completion_tokens == 16
    assert spec_server.llm.stats().spec_decode.num_accepted_tokens > 0
    spec_server.assert_no_leak()
