"""`flotilla gateway bench`: its pure parts (percentiles, exposition parsing, the workload, the summaries,
the commands it builds). No processes: the benchmarks themselves run by hand."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from flotilla.bench.gateway import routing
from flotilla.bench.gateway.bounds import bound_config
from flotilla.bench.gateway.figures import (
    BOUND_PLANES,
    CLIENT_BOUND_SHARE,
    ENVOY_ALONE,
    NULL_PICKER,
    NULL_PICKER_REQUEST_PHASES,
    ChatRecord,
    added_latency,
    ceiling_comparison,
    compare_policies,
    cpu_shares,
    data_planes,
    distribution,
    format_overhead,
    format_routing,
    json_safe,
    latency_summary,
    percentile,
    routing_summary,
    sample_by_label,
    sample_sum,
    throughput_summary,
)
from flotilla.bench.gateway.procs import (
    PYTHON_CLI,
    cpu_seconds,
    engine_argv,
    envoy_argv,
    envoy_config_argv,
    gateway_argv,
)
from flotilla.bench.gateway.stub import answer
from flotilla.bench.gateway.workload import chat_messages, longest_prompt_words, make_workload
from flotilla.cli import build_parser
from flotilla.contract import (
    ENGINE_SERVE,
    ENGINE_TOKENIZER_PATH,
    FLAG_MODEL,
    FLAG_PORT,
    FLAG_SHUTDOWN_DELAY,
    GATEWAY_ROUTING_DECISIONS,
    LABEL_REASON,
    OPENAI_PATH,
    PREFIX_CACHE_HITS,
    counter_total,
)
from flotilla.gateway.proxy.bootstrap import (
    ENGINES_CLUSTER,
    EXT_PROC_FILTER,
    ROUTER,
    bootstrap,
    processing_mode,
)


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile([7.0], 95) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_distribution_is_in_milliseconds() -> None:
    d = distribution([0.001, 0.002, 0.003])
    assert d["n"] == 3
    assert d["p50"] == pytest.approx(2.0)
    assert d["mean"] == pytest.approx(2.0)
    assert d["max"] == pytest.approx(3.0)
    assert set(d) == {"n", "mean", "p50", "p90", "p95", "p99", "max"}


EXPOSITION = f"""# HELP flotilla_prefix_cache_hits_total Prompt tokens found in the prefix cache.
# TYPE flotilla_prefix_cache_hits_total counter
{counter_total(PREFIX_CACHE_HITS)}{{model="tiny",service="",tenant=""}} 120.0
{counter_total(PREFIX_CACHE_HITS)}{{model="other",service="",tenant=""}} 30.0
{PREFIX_CACHE_HITS}_created{{model="tiny"}} 1.7e9
{counter_total(GATEWAY_ROUTING_DECISIONS)}{{{LABEL_REASON}="prefix_hit"}} 7.0
{counter_total(GATEWAY_ROUTING_DECISIONS)}{{{LABEL_REASON}="least_load"}} 2.0
plain_gauge 3
"""


def test_exposition_sums_and_groups_by_label() -> None:
    assert sample_sum(EXPOSITION, counter_total(PREFIX_CACHE_HITS)) == 150.0
    assert sample_sum(EXPOSITION, "plain_gauge") == 3.0
    assert sample_sum(EXPOSITION, "absent_total") == 0.0
    by_reason = sample_by_label(EXPOSITION, counter_total(GATEWAY_ROUTING_DECISIONS), LABEL_REASON)
    assert by_reason == {"prefix_hit": 7.0, "least_load": 2.0}


def test_workload_is_deterministic_and_shaped_as_asked() -> None:
    a = make_workload(systems=4, users=10, turns=3, system_words=50, user_words=8, seed=3)
    b = make_workload(systems=4, users=10, turns=3, system_words=50, user_words=8, seed=3)
    c = make_workload(systems=4, users=10, turns=3, system_words=50, user_words=8, seed=4)
    assert a == b
    assert a != c
    assert len(set(a.system_prompts)) == 4
    # distinct from the first word: no block of one system prompt is a block of another
    assert len({p.split()[0] for p in a.system_prompts}) == 4
    assert [c.index for c in a.conversations] == list(range(10))
    assert sorted(c.user for c in a.conversations) == list(range(10))
    assert all(c.system == c.user % 4 and len(c.messages) == 3 for c in a.conversations)
    assert a.turns == 3 and a.requests == 30
    assert all(len(p.split()) == 50 for p in a.system_prompts)


def test_workload_preamble_is_shared() -> None:
    w = make_workload(systems=3, users=3, turns=1, system_words=20, user_words=5, preamble_words=6)
    firsts = {tuple(p.split()[:6]) for p in w.system_prompts}
    assert len(firsts) == 1
    assert len({p.split()[6] for p in w.system_prompts}) == 3
    with pytest.raises(ValueError):
        make_workload(systems=0, users=1, turns=1, system_words=1, user_words=1)


def test_chat_messages_carry_the_history() -> None:
    messages = chat_messages("sys", [("q0", "a0"), ("q1", "a1")], "q2")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in messages] == ["sys", "q0", "a0", "q1", "a1", "q2"]
    w = make_workload(systems=1, users=2, turns=2, system_words=10, user_words=3)
    assert longest_prompt_words(w, reply_words=4) == max(
        len(w.system_prompts[0].split()) + sum(len(m.split()) for m in c.messages) + 4
        for c in w.conversations
    )


def _records(ttfts: list[float], turn: int = 0) -> list[ChatRecord]:
    return [ChatRecord(conversation=i, system=0, turn=turn, start=0.0, ok=True, ttft=t, latency=t + 0.1,
                       output_tokens=16, prompt_tokens=100, cached_tokens=50) for i, t in enumerate(ttfts)]  # fmt: skip


def test_routing_summary_and_comparison() -> None:
    failed = ChatRecord(conversation=9, system=0, turn=1, start=0.0, error="HTTP 500: boom")
    slow = routing_summary(_records([0.4] * 19 + [2.0]) + [failed], 10.0, engine_hits=50, engine_queries=100,
                           gateway_hit_tokens=0, gateway_prompt_tokens=2000, decisions={"round_robin": 20},
                           replica_requests=[7, 7, 6])  # fmt: skip
    fast = routing_summary(_records([0.1] * 20, turn=1), 5.0, engine_hits=90, engine_queries=100,
                           gateway_hit_tokens=1800, gateway_prompt_tokens=2000, decisions={"prefix_hit": 20, "least_load": 0})  # fmt: skip
    assert slow["requests"] == 21 and slow["ok"] == 20 and slow["failed"] == 1
    assert slow["errors"] == ["HTTP 500: boom"]
    assert slow["output_tok_s"] == pytest.approx(32.0)
    assert slow["engine_prefix_hit_rate"] == pytest.approx(0.5)
    assert slow["usage_cached_share"] == pytest.approx(0.5)
    assert slow["replica_requests"] == [7, 7, 6]
    assert fast["gateway_predicted_hit_share"] == pytest.approx(0.9)
    assert fast["routing_decisions"] == {"prefix_hit": 20}
    assert fast["ttft_first_turn_ms"]["n"] == 0 and fast["ttft_later_turns_ms"]["n"] == 20
    comparison = compare_policies({"round-robin": slow, "prefix": fast}, target=2.0)
    assert comparison is not None
    assert comparison["ttft_p95_ratio"] == pytest.approx(slow["ttft_ms"]["p95"] / 100.0)
    assert (comparison["baseline"], comparison["candidate"], comparison["met"]) == (
        "round-robin",
        "prefix",
        True,
    )
    same = compare_policies({"a": fast, "b": fast}, target=2.0)
    assert same is not None and same["met"] is False
    assert compare_policies({"prefix": fast}, target=2.0) is None
    assert "target" not in format_routing({"prefix": fast}, None)
    report = json.loads(
        json.dumps(json_safe({"policies": {"rr": slow, "prefix": fast}, "comparison": comparison}))
    )
    assert report["policies"]["prefix"]["ttft_first_turn_ms"]["p50"] is None  # NaN -> null
    text = format_routing({"round-robin": slow, "prefix": fast}, comparison)
    assert "round-robin / prefix: " in text and "MET" in text and "7/7/6" in text


def test_added_latency_checks_each_target() -> None:
    direct = [0.010, 0.011, 0.012]
    summary = added_latency(direct, [0.0115, 0.0125, 0.0135], {"p50": 2.0})
    assert summary["added_ms"]["p50"] == pytest.approx(1.5)
    assert summary["targets"]["p50"]["met"] is True and summary["met"] is True
    # p50 within, p99 not: the plane misses
    tail = added_latency(direct, [0.0105, 0.0115, 0.030], {"p50": 1.0, "p99": 5.0})
    assert tail["targets"]["p50"]["met"] is True
    assert tail["targets"]["p99"]["added_ms"] == pytest.approx(30.0 - 12.0, rel=0.05)
    assert tail["targets"]["p99"]["met"] is False and tail["met"] is False
    assert added_latency(direct, [0.013, 0.014, 0.015], {"p50": 2.0})["met"] is False
    assert added_latency([], [], {"p50": 2.0})["met"] is False  # no samples: NaN, never met
    assert added_latency(direct, direct, {})["met"] is False  # nothing to meet


def test_latency_summary_per_data_plane() -> None:
    samples = {"direct": [0.010] * 5, "relay": [0.013] * 5, "envoy": [0.0105] * 5}
    targets = {"relay": {"p50": 2.0}, "envoy": {"p50": 1.0, "p99": 5.0}}
    summary = latency_summary(samples, targets)
    assert summary["direct_ms"]["p50"] == pytest.approx(10.0)
    assert list(summary["data_planes"]) == ["relay", "envoy"]
    relay, envoy = summary["data_planes"]["relay"], summary["data_planes"]["envoy"]
    assert relay["added_ms"]["p50"] == pytest.approx(3.0) and relay["met"] is False
    assert envoy["added_ms"]["p99"] == pytest.approx(0.5) and envoy["met"] is True
    assert set(envoy["targets"]) == {"p50", "p99"} and set(relay["targets"]) == {"p50"}


def test_ceiling_comparison_against_the_target() -> None:
    relay = throughput_summary([0.01] * 1000, errors=0, duration=1.0, concurrency=32)
    envoy = throughput_summary([0.002] * 6000, errors=0, duration=1.0, concurrency=32)
    client = throughput_summary([0.001] * 20000, errors=0, duration=1.0, concurrency=32)
    met = ceiling_comparison({"relay": relay, "envoy": envoy}, client, target=5.0)
    assert met["envoy_over_relay"] == pytest.approx(6.0) and met["met"] is True
    assert met["client_bound"] == []
    missed = ceiling_comparison({"relay": relay, "envoy": envoy}, client, target=10.0)
    assert missed["met"] is False
    slow_client = throughput_summary([0.001] * 7000, errors=0, duration=1.0, concurrency=32)
    bound = ceiling_comparison({"relay": relay, "envoy": envoy}, slow_client, target=5.0)
    assert bound["client_bound"] == ["envoy"]  # 6000 >= CLIENT_BOUND_SHARE x 7000
    assert 6000 >= CLIENT_BOUND_SHARE * 7000 > 1000
    alone = ceiling_comparison({"envoy": envoy}, client, target=5.0)
    assert alone["envoy_over_relay"] is None and alone["met"] is False
    t = throughput_summary([0.01] * 500, errors=1, duration=2.0, concurrency=32)
    assert t["requests_per_s"] == 250.0 and t["errors"] == 1 and t["latency_ms"]["p50"] == pytest.approx(10.0)


def test_every_plane_is_read_over_the_relay_and_the_bounds_leave_the_target_alone() -> None:
    relay = throughput_summary([0.01] * 1000, errors=0, duration=1.0, concurrency=32)
    envoy = throughput_summary([0.01] * 900, errors=0, duration=1.0, concurrency=32)
    null = throughput_summary([0.002] * 5500, errors=0, duration=1.0, concurrency=32)
    client = throughput_summary([0.001] * 20000, errors=0, duration=1.0, concurrency=32)
    read = ceiling_comparison({"relay": relay, "envoy": envoy, NULL_PICKER: null}, client, target=5.0)
    assert read["over_relay"] == {"envoy": pytest.approx(0.9), NULL_PICKER: pytest.approx(5.5)}
    assert read["met"] is False  # the target is Envoy + Flotilla's picker's, never a bound's
    text = format_overhead(_overhead_report(("relay", "envoy", NULL_PICKER)))
    assert "Envoy + null Go picker over the relay: 5.50x (a bound)" in text
    assert "Envoy + picker over the relay: 6.00x (target >= 5x: MET)" in text


def test_the_bound_bootstraps_differ_from_the_served_one_only_where_they_say() -> None:
    served = bootstrap(picker_host="127.0.0.1", picker_port=9002, listen_port=8080, admin_port=9901)

    def http_filters(config: dict) -> list[dict]:
        manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        return manager["typed_config"]["http_filters"]

    def engines(config: dict) -> dict:
        return next(c for c in config["static_resources"]["clusters"] if c["name"] == ENGINES_CLUSTER)

    for plane in BOUND_PLANES:
        config = bound_config(served, plane, upstream_port=7000)
        endpoint = engines(config)["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        assert endpoint["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 7000}
        assert engines(config)["type"] == "STATIC" and "eds_cluster_config" not in engines(config)
        names = [f["name"] for f in http_filters(config)]
        assert (EXT_PROC_FILTER in names) == (plane != ENVOY_ALONE)
        assert names[-1] == ROUTER["name"]
    assert engines(served)["type"] == "EDS"  # the served bootstrap is left as it was
    modes = {
        plane: next(
            f for f in http_filters(bound_config(served, plane, 7000)) if f["name"] == EXT_PROC_FILTER
        )["typed_config"]["processing_mode"]
        for plane in (NULL_PICKER, NULL_PICKER_REQUEST_PHASES)
    }
    assert modes[NULL_PICKER] == processing_mode("BUFFERED")
    assert modes[NULL_PICKER_REQUEST_PHASES]["response_header_mode"] == "SKIP"
    assert modes[NULL_PICKER_REQUEST_PHASES]["response_body_mode"] == "NONE"
    assert modes[NULL_PICKER_REQUEST_PHASES]["request_body_mode"] == "BUFFERED"
    with pytest.raises(ValueError, match="plane must be one of envoy-alone"):
        bound_config(served, "envoy", 7000)


def test_cpu_shares_of_one_core() -> None:
    shares = cpu_shares(
        {"envoy": 10.0, "picker": 20.0, "gone": None}, {"envoy": 10.5, "picker": 21.8, "gone": 3.0}, 2.0
    )
    assert shares == {"envoy": pytest.approx(0.25), "picker": pytest.approx(0.9), "gone": None}
    assert cpu_shares({"a": 1.0}, {"a": 2.0}, 0.0) == {"a": None}
    mine = cpu_seconds(os.getpid())
    assert mine is not None and mine > 0
    assert cpu_seconds(None) is None


def _overhead_report(planes: tuple[str, ...]) -> dict:
    targets = {"relay": {"p50": 2.0}, "envoy": {"p50": 1.0, "p99": 5.0}}
    samples = {"direct": [0.010] * 5, "relay": [0.013] * 5, "envoy": [0.0105] * 5}
    latency = latency_summary({k: v for k, v in samples.items() if k == "direct" or k in planes}, targets)
    latency.update(errors=0)
    loops = {"relay": [0.01] * 1000, "envoy": [0.002] * 6000, NULL_PICKER: [0.002] * 5500}
    throughput: dict = {p: throughput_summary(loops[p], 0, 1.0, 32) for p in planes}
    if "envoy" in planes:
        throughput["envoy"]["cpu_share"] = {"envoy": 0.25, "picker": 0.75}
    client = throughput_summary([0.001] * 20000, 0, 1.0, 32)
    throughput.update(stub_direct=client, comparison=ceiling_comparison(throughput, client, 5.0))
    return {"settings": {"gateway_cpu": 1}, "latency": latency, "latency_instant_upstream": latency,
            "throughput": throughput}  # fmt: skip


def test_format_overhead_shows_both_planes_and_the_verdicts() -> None:
    text = format_overhead(_overhead_report(("relay", "envoy")))
    assert "through the relay" in text and "through Envoy + picker" in text
    assert "p50 0.500 ms (target <= 1 ms: MET)" in text
    assert "p50 3.000 ms (target <= 2 ms: MISSED)" in text
    assert "Envoy + picker over the relay: 6.00x (target >= 5x: MET)" in text
    assert "1000 requests/s" in text and "6000 requests/s" in text
    assert "of the core: envoy 25%, picker 75%" in text
    alone = format_overhead(_overhead_report(("envoy",)))
    assert "through the relay" not in alone and "over the relay" not in alone
    json.dumps(json_safe(_overhead_report(("relay", "envoy"))))  # the JSON it is written as
    assert "warning" not in text
    bound = _overhead_report(("relay", "envoy"))
    slow = throughput_summary([0.001] * 7000, 0, 1.0, 32)
    bound["throughput"]["comparison"] = ceiling_comparison(
        {p: bound["throughput"][p] for p in ("relay", "envoy")}, slow, 5.0
    )
    assert "warning: Envoy + picker came within 70% of the client's own ceiling" in format_overhead(bound)


def test_commands_use_this_interpreter_and_the_contract() -> None:
    argv = engine_argv(Path("/m"), "tiny", 1234, "256MiB", 1)
    assert argv[: len(PYTHON_CLI)] == list(PYTHON_CLI)
    assert argv[len(PYTHON_CLI) : len(PYTHON_CLI) + 2] == list(ENGINE_SERVE[1:])
    assert argv[argv.index(FLAG_MODEL) + 1] == "/m" and argv[argv.index(FLAG_PORT) + 1] == "1234"
    assert argv[argv.index(FLAG_SHUTDOWN_DELAY) + 1] == "0"
    assert argv[argv.index("--threads") + 1] == "1"
    parsed = build_parser().parse_args(argv[len(PYTHON_CLI) :])  # the engine's own parser accepts it
    assert parsed.port == 1234 and parsed.threads == 1
    gateway = gateway_argv({"tiny": ["http://a", "http://b"]}, "prefix", 99)
    parsed = build_parser().parse_args(gateway[len(PYTHON_CLI) :])
    assert parsed.static_model == ["tiny=http://a,http://b"] and parsed.routing == "prefix"
    assert parsed.picker_port is None
    picker = gateway_argv({"tiny": ["http://a"]}, "round-robin", 99, picker_port=98)
    parsed = build_parser().parse_args(picker[len(PYTHON_CLI) :])
    assert parsed.picker_port == 98 and parsed.port == 99 and parsed.routing == "round-robin"
    config = envoy_config_argv(picker_port=98, port=97, admin_port=96)
    parsed = build_parser().parse_args(config[len(PYTHON_CLI) :])  # the gateway's own parser accepts it
    assert (parsed.picker, parsed.port, parsed.admin_port) == ("127.0.0.1:98", 97, 96)
    envoy = envoy_argv("/bin/envoy", Path("/tmp/e.json"), 1)
    assert envoy[0] == "/bin/envoy" and envoy[envoy.index("--concurrency") + 1] == "1"


def test_bench_flags_parse() -> None:
    args = build_parser().parse_args(
        ["gateway", "bench", "routing", "--users", "12", "--policies", "round-robin,prefix"]
    )
    assert args.users == 12 and args.policies == ("round-robin", "prefix") and args.concurrency >= 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "bench", "routing", "--policies", "random"])
    assert args.data_plane == "envoy"
    args = build_parser().parse_args(["gateway", "bench", "overhead", "--requests", "50"])
    assert args.requests == 50 and args.concurrency == 32 and args.data_plane == "both"
    assert (args.envoy_target_p50_ms, args.envoy_target_p99_ms, args.throughput_target) == (1.0, 5.0, 5.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "bench", "overhead", "--data-plane", "nginx"])
    # overhead measures the baseline (the relay) first; routing the target's data plane (Envoy)
    assert data_planes("both", first="relay") == ("relay", "envoy")
    assert data_planes("envoy", first="relay") == ("envoy",)
    assert data_planes("both", first="envoy") == ("envoy", "relay")
    assert data_planes("relay", first="envoy") == ("relay",)
    # a run is named by its policy alone with one data plane, by both with several (logs, PNG)
    assert routing.run_label("prefix", "envoy", ("envoy",)) == "prefix"
    assert routing.run_label("prefix", "relay", ("envoy", "relay")) == "prefix (relay)"


def test_stub_answers() -> None:
    ok = answer("POST", OPENAI_PATH + "/completions")
    assert ok.startswith(b"HTTP/1.1 200 OK\r\n")
    head, _, body = ok.partition(b"\r\n\r\n")
    assert int(dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])[b"content-length"]) == len(body)
    assert json.loads(body)["choices"][0]["text"]
    assert answer("GET", ENGINE_TOKENIZER_PATH).startswith(b"HTTP/1.1 404")
