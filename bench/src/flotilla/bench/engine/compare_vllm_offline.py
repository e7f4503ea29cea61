"""`flotilla engine bench offline --compare vllm --vllm-python PATH`: Flotilla's LLMEngine.generate against
vLLM's LLM.generate on the same model folder, the same token-id prompts and output lengths (greedy,
ignore_eos), the same cores, batch limits, KV budget and prefix caching. Each system runs in a process of its
own (offline_peer.py), loaded once; then `--rounds` rounds, the order alternating, each running the whole
workload on both (new prompts each round; before each run, the harness waits until both systems' processes
are idle: vLLM's worker spins its OpenMP threads for seconds after a batch). Reports output tok/s per round, Flotilla/vLLM per round and its median, load times and
greedy agreement; prints them, writes --json and --png. Asserts nothing."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flotilla.bench.engine import compare_report, offline_peer, vllm_peer
from flotilla.bench.engine.offline import Workload, make_workload, parse_range
from flotilla.bench.engine.peer_procs import OtherLoad, Peer, PeerError, progress

COMMAND = "flotilla engine bench offline"
LOAD_TIMEOUT_S = 1800.0  # vLLM compiles the model as it loads: minutes on two cores
RUN_TIMEOUT_S = 3600.0


def resolve_dtype(dtype: str, model: str) -> str:
    """`--dtype` as Flotilla resolves it on a CPU (auto: float32), so that vLLM gets the same."""
    import torch

    from flotilla.engine.model.config import ModelConfig
    from flotilla.engine.model.loader import resolve_dtype as engine_dtype

    config = ModelConfig.from_file(Path(model) / "config.json")
    return str(engine_dtype(dtype, config, torch.device("cpu"))).replace("torch.", "")


def vllm_versions(vllm_python: str, env: dict[str, str]) -> str:
    """'VLLM TORCH' from the peer's python, or a PeerError saying why it cannot import vLLM."""
    done = subprocess.run(vllm_peer.version_argv(vllm_python), env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    if done.returncode != 0:
        raise PeerError(
            f"{vllm_python} cannot import vLLM (exit {done.returncode}):\n{done.stderr.strip()[-2000:]}"
        )
    return done.stdout.strip().splitlines()[-1]


def peer_argv(system: str, vllm_python: str, job_file: Path) -> list[str]:
    if system == "vllm":
        return vllm_peer.offline_peer_argv(vllm_python, offline_peer.__file__, str(job_file))
    return [sys.executable, "-m", offline_peer.__name__, str(job_file)]


def workloads(args: argparse.Namespace, vocab: int) -> list[Workload]:
    """The warm-up's workload, then each round's: the same sizes and length ranges, new prompts each time
    (seeded by --seed and the round), so that no round finds the previous one's prompts in either
    system's prefix cache. Both systems run the same prompts in a round."""
    input_len, output_len = parse_range(args.input_len), parse_range(args.output_len)
    return [
        make_workload(args.num_prompts, input_len, output_len, vocab, args.seed + 1000 * k)
        for k in range(args.rounds + 1)
    ]


def run_compare_offline(args: argparse.Namespace) -> int:
    try:
        vllm_python = vllm_peer.check_vllm_python(args.compare, args.vllm_python)
        assert vllm_python is not None
        if args.device not in ("auto", "cpu"):
            raise vllm_peer.CompareError("--compare vllm compares vLLM's CPU backend: --device must be cpu")
        orders = compare_report.round_orders(args.rounds)
        for lengths in (args.input_len, args.output_len):  # a bad range fails here, before any load
            parse_range(lengths)
        settings = vllm_peer.namespace_settings(
            args, args.model, resolve_dtype(args.dtype, args.model), vllm_peer.cpus_for(args.threads)
        )
    except ValueError as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return 2
    vocab = json.loads((Path(settings.model) / "config.json").read_text())["vocab_size"]
    works = workloads(args, vocab)
    tcmalloc = vllm_peer.find_tcmalloc(vllm_python)
    envs = {"flotilla": dict(os.environ), "vllm": vllm_peer.vllm_env(os.environ, settings, tcmalloc)}
    workdir = Path(tempfile.mkdtemp(prefix="flotilla-vs-vllm-"))
    peers: dict[str, Peer] = {}
    try:
        progress(f"vllm: checking {vllm_python} ...")
        versions = vllm_versions(vllm_python, envs["vllm"])
        progress(f"vllm: {versions} (vLLM, torch); {args.num_prompts} prompts, input {args.input_len}, "
                 f"output {args.output_len}, {args.rounds} rounds, CPUs {list(settings.cpus)}")  # fmt: skip
        loads = {}
        for system in compare_report.SYSTEMS:  # one at a time: a load is not measured beside another
            job = {"system": system, "settings": {**vars(settings), "cpus": list(settings.cpus)},
                   "workloads": [vars(w) for w in works]}  # fmt: skip
            job_file = workdir / f"{system}-job.json"
            job_file.write_text(json.dumps(job))
            peers[system] = Peer(system, peer_argv(system, vllm_python, job_file), workdir / f"{system}.log",
                                 envs[system], settings.cpus).start()  # fmt: skip
            progress(f"{system}: loading {Path(settings.model).name} ...")
            loads[system] = ready = peers[system].receive("loading", LOAD_TIMEOUT_S)
            ready["ready_s"] = time.perf_counter() - peers[system].started
            progress(f"{system}: ready in {ready['ready_s']:.1f} s (load {ready['load_s']:.1f} s)")
        for system in compare_report.SYSTEMS:
            progress(f"warm-up: {system} generating {args.num_prompts} requests (not measured) ...")
            generate(peers, system, 0)
        rounds = []
        for number, order in enumerate(orders, 1):
            measured: dict[str, Any] = {"order": list(order), "output_tokens": works[number].output_tokens}
            for system in order:
                progress(f"round {number}/{len(orders)}: {system} generating {args.num_prompts} requests ...")
                measured[system] = ran = generate(peers, system, number)
                progress(f"round {number}: {system} {ran['tokens_per_s']:.1f} output tok/s; other work took "
                         f"{ran['other_load']['share']:.0%} of those cores meanwhile")  # fmt: skip
            rounds.append(measured)
    except PeerError as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        print(f"{COMMAND}: the logs are in {workdir}", file=sys.stderr)
        return 1
    finally:
        for peer in peers.values():
            peer.quit()
    report = build_report(args, settings, versions, tcmalloc, loads, rounds)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        progress(f"wrote {args.json}")
    if args.png:
        from flotilla.bench.engine.compare_figures import plot_offline

        plot_offline(report, args.png)
        progress(f"wrote {args.png}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def generate(peers: dict[str, Peer], system: str, workload: int) -> dict[str, Any]:
    """One run of a workload by one system, once both systems' processes are idle (neither measures
    beside the other's leftover work)."""
    waited = sum(p.wait_quiet() for p in peers.values())
    peer = peers[system]
    with OtherLoad(peers.values(), peer.cpus) as load:
        peer.send({"cmd": "run", "workload": workload})
        ran = peer.receive("generating", RUN_TIMEOUT_S)
    return {
        "seconds": ran["seconds"],
        "output_tokens": ran["output_tokens"],
        "tokens_per_s": ran["output_tokens"] / ran["seconds"],
        "token_ids": ran["token_ids"],
        "waited_for_quiet_s": waited,
        "other_load": {"cpu_s": load.cpu_s, "share": load.share},
    }


def build_report(args, settings, versions: str, tcmalloc, loads, rounds) -> dict[str, Any]:
    """The report: the workload, what each system was given, its load, its rounds and the comparison.
    Greedy agreement is over every measured round's requests."""
    tokens: dict[str, list[list[int]]] = {s: [] for s in compare_report.SYSTEMS}
    for r in rounds:
        for s in compare_report.SYSTEMS:
            tokens[s] += r[s].pop("token_ids")
    rates = {s: [r[s]["tokens_per_s"] for r in rounds] for s in compare_report.SYSTEMS}
    vllm_version, _, vllm_torch = versions.partition(" ")
    return {
        "comparison": "offline",
        "model": settings.model,
        "num_prompts": args.num_prompts,
        "input_len": list(parse_range(args.input_len)),
        "output_len": list(parse_range(args.output_len)),
        "rounds": rounds,
        "fairness": vllm_peer.fairness(settings, tcmalloc),
        "systems": {
            "flotilla": {**loads["flotilla"], "engine": "LLMEngine.generate"},
            "vllm": {**loads["vllm"], "engine": "LLM.generate", "version": vllm_version, "torch": vllm_torch},
        },
        "output_tok_s": rates,
        "ratio": compare_report.ratios(rates["flotilla"], rates["vllm"]),
        "greedy_agreement": compare_report.greedy_agreement(tokens["flotilla"], tokens["vllm"]),
    }


def print_report(r: dict[str, Any]) -> None:
    f = r["fairness"]
    print(f"flotilla vs vLLM {r['systems']['vllm']['version']}, offline: {r['model']}")
    print(f"  {r['num_prompts']} prompts a round (new ones each round, the same for both), input "
          f"{r['input_len']}, output {r['output_len']} tokens; greedy, ignore_eos; one warm-up round")  # fmt: skip
    print(f"  {f['dtype']}, {f['threads']} threads: {f['binding']}")
    print(f"  max_num_seqs {f['max_num_seqs']}, max_num_batched_tokens {f['max_num_batched_tokens']}, "
          f"KV {f['kv_cache_bytes_each'] / 2**30:.2f} GiB each, prefix caching "
          f"{'on' if f['prefix_caching'] else 'off'} for both, block sizes flotilla {f['block_sizes']['flotilla']} "
          f"/ vllm {f['block_sizes']['vllm']}, preloads: vllm {f['preloads']['vllm']}")  # fmt: skip
    for number, (rnd, ratio) in enumerate(zip(r["rounds"], r["ratio"]["per_round"], strict=True), 1):
        rates = ", ".join(f"{s} {rnd[s]['tokens_per_s']:.1f}" for s in rnd["order"])
        others = ", ".join(f"{s} {rnd[s]['other_load']['share']:.0%}" for s in rnd["order"])
        print(f"  round {number} ({rnd['order'][0]} first): {rates} output tok/s; "
              f"flotilla/vllm {compare_report.fmt_ratio(ratio)} (other work on the cores: {others})")  # fmt: skip
    median = r["ratio"]["median"]
    verdict = compare_report.verdict("output_tok_s", median)
    print(
        f"  median flotilla/vllm output tok/s: {compare_report.fmt_ratio(median)} (target >= 1.25: {verdict})"
    )
    for s, load in r["systems"].items():
        print(f"  {s}: loaded in {load['load_s']:.1f} s, ready (process start to loaded and warm) in "
              f"{load['ready_s']:.1f} s; {load['info'].get('kv_cache_tokens')} KV tokens")  # fmt: skip
    g = r["greedy_agreement"]
    print(f"  greedy: {g['identical']} of {g['requests']} requests identical; mean matching prefix "
          f"{g['mean_matching_prefix_share']:.3f}")  # fmt: skip
