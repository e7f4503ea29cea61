"""Each kind of bad input gets its own test: a clear 4xx in OpenAI's error shape, the server stays up,
and no KV block leaks (the `server` fixture checks the block count after every test)."""

from __future__ import annotations

import httpx

MODEL = "tiny"


def assert_error(resp: httpx.Response, status: int, param: str | None = None, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def complete(http, **body):
    return http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2} | body)


def test_invalid_json(http):
    resp = http.post(
        "/v1/completions",
        content=b'{"model": "tiny", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert_error(resp, 400, None, "not valid JSON")


def test_body_not_an_object(http):
    assert_error(http.post("/v1/completions", json=["model", "prompt"]), 400, None, "JSON object")


def test_wrong_type_names_the_field(http):
    assert_error(complete(http, max_tokens="ten"), 400, "max_tokens")
    assert_error(complete(http, temperature={"x": 1}), 400, "temperature")
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": 5}]}),
                 400, "messages.0.content")  # fmt: skip


def test_missing_model(http):
    assert_error(http.post("/v1/completions", json={"prompt": "hi"}), 400, "model", "required")


def test_missing_prompt(http):
    assert_error(http.post("/v1/completions", json={"model": MODEL}), 400, "prompt", "required")


def test_missing_messages(http):
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL}), 400, "messages", "required")


def test_unknown_model_is_404(http):
    error = assert_error(complete(http, model="gpt-9"), 404, "model", "gpt-9")
    assert error["code"] == "model_not_found"


def test_prompt_plus_max_tokens_past_context_states_both_numbers(http, server):
    limit = server.llm.max_model_len
    n = http.post("/tokenize", json={"prompt": "hi"}).json()["count"]
    error = assert_error(
        complete(http, max_tokens=limit), 400, "max_tokens", str(n), str(limit), str(n + limit)
    )
    assert error["code"] == "context_length_exceeded"


def test_prompt_alone_past_context(http, server):
    limit = server.llm.max_model_len
    assert_error(complete(http, prompt=[5] * (limit + 3)), 400, "prompt", str(limit + 3), str(limit))


def test_chat_max_completion_tokens_past_context(http, server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10_000}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "max_completion_tokens", "10000")


def test_negative_temperature(http):
    assert_error(complete(http, temperature=-0.5), 400, "temperature")


def test_top_p_zero(http):
    assert_error(complete(http, top_p=0), 400, "top_p")


def test_top_p_above_one(http):
    assert_error(complete(http, top_p=1.5), 400, "top_p")


def test_max_tokens_zero(http):
    assert_error(complete(http, max_tokens=0), 400, "max_tokens")


def test_max_tokens_negative(http):
    assert_error(complete(http, max_tokens=-3), 400, "max_tokens")


def test_token_ids_outside_vocabulary(http):
    assert_error(complete(http, prompt=[1, 10**9]), 400, "prompt", "vocabulary")


def test_empty_prompt_list(http):
    assert_error(complete(http, prompt=[]), 400, "prompt")


def test_too_many_choices(http):
    assert_error(complete(http, n=64), 400, "n")


def test_unsupported_fields_are_refused(http):
    assert_error(complete(http, logit_bias={"5": 10}), 400, "logit_bias")
    assert_error(complete(http, echo=True), 400, "echo")


def test_body_over_the_size_limit_is_413(http):
    big = b'{"model": "tiny", "prompt": "' + b"a" * (9 << 20) + b'"}'
    assert_error(http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)


def test_chunked_body_over_the_limit_is_413(http):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'"}'

    assert_error(http.post("/v1/completions", content=chunks()), 413)


def test_non_utf8_body(http):
    resp = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": "\xff\xfe"}',
                     headers={"content-type": "application/json"})  # fmt: skip
    assert_error(resp, 400, None, "UTF-8")


def test_unknown_route_is_openai_shaped_404(http):
    assert_error(http.get("/v1/nothing"), 404)


def test_wrong_method_is_405(http):
    assert_error(http.get("/v1/completions"), 405)


def test_tokenize_needs_exactly_one_input(http):
    assert_error(http.post("/tokenize", json={}), 400, "prompt")


def test_detokenize_outside_vocabulary(http):
    assert_error(http.post("/detokenize", json={"tokens": [10**8]}), 400, "tokens")


def test_server_still_serves_after_bad_input(http):
    assert complete(http).status_code == 200


def test_full_queue_is_429_with_retry_after(make_server):
    import threading

    from .conftest import wait_for

    server = make_server({"max_num_seqs": 1}, max_queue=1)
    # Hold the engine between steps so the first request stays running and the second stays queued.
    gate = threading.Event()
    gate.set()
    execute = server.llm.runner.execute
    server.llm.runner.execute = lambda sched: gate.wait() and execute(sched)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 100, "ignore_eos": True, "stream": True}
    queued_status: list[int] = []

    def queued() -> None:  # its response starts with its first token, so it waits in a thread
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, trust_env=False, timeout=60
        ) as rsp:
            queued_status.append(rsp.status_code)
            rsp.read()

    with (
        httpx.Client(base_url=server.url, trust_env=False, timeout=60) as a,
        a.stream("POST", "/v1/completions", json=body) as running,
    ):
        lines = running.iter_lines()  # keep it: a dropped iterator closes the connection
        next(lines)  # the first request holds the only batch slot
        gate.clear()
        waiter = threading.Thread(target=queued)
        waiter.start()
        wait_for(lambda: server.state.in_flight == 2, what="the second request accepted into the queue")
        full = httpx.post(f"{server.url}/v1/completions", json=body, trust_env=False)
        error = assert_error(full, 429, None, "queue is full")
        assert error["code"] == "queue_full" and full.headers["retry-after"] == "1"
        # Queued, with no output: its response has not started (a data plane could still retry it).
        assert queued_status == []
        gate.set()
    waiter.join(60)
    assert queued_status == [200]  # it waited: the queue holds one
    server.assert_no_leak()


def test_api_key_missing_is_401(make_server):
    server = make_server(api_key="sekret")
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, trust_env=False)
    assert_error(resp, 401, None, "missing")
    assert httpx.get(f"{server.url}/health", trust_env=False).status_code == 200  # probes need no key
    assert httpx.get(f"{server.url}/metrics", trust_env=False).status_code == 200


def test_api_key_wrong_is_401_and_right_is_200(make_server):
    server = make_server(api_key="sekret")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    wrong = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}, trust_env=False
    )
    assert_error(wrong, 401, None, "invalid")
    right = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}, trust_env=False
    )
    assert right.status_code == 200
    server.assert_no_leak()
