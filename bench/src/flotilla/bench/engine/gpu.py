"""`flotilla engine bench gpu --out DIR`: one check of the engine on a CUDA machine, within ten minutes on
an H200, written to DIR/gpu-check.json (after every check, so a failure keeps what came before) and
DIR/gpu-check.png (each ratio against its target).

The checks, in order, each with a time budget (the sizes are in the JSON; gpu_figures.py has them):
1. copy_bandwidth: a device-to-device copy of 1 GiB, bytes read plus written over the median time: the
   ceiling the two bandwidth figures are measured against.
2. kernels: the Triton kernels (decode over GQA ratios 1/3/4/8, head dims 64/128, blocks 16/32, ragged
   lengths with 1, 2 and 16 splits; varlen prefill over cached prefixes; the KV store) against the torch
   reference on the device, in float16 and bfloat16: max abs error and pass/fail per case.
3. decode_attention_bandwidth: the decode kernel over 64 requests of 4096 tokens (and three other shapes):
   KV + q + out bytes over the median time, over the copy bandwidth. Target >= 0.80.
4. model: the random ~1B Llama (gpu_model.py) written to DIR/model once, reused after.
5. batch1_decode: the engine (LLMEngine, as `bench offline` builds it) on one request: decode tok/s after
   the first token; weight bytes x tok/s over the copy bandwidth. Target >= 0.70.
6. throughput_vs_transformers: `bench offline`'s comparison (its workload, run_engine, hf_sequential and
   hf_static_batches) with a fixed output length, plus transformers' generate_batch
   (hf_generate_batch.py). Target: engine >= 2x generate_batch.

A check that fails is recorded with its error and the run goes on; the exit status is 1 when any check
failed, 0 otherwise (targets are reported, not asserted). `--quick --device cpu` runs the same code with
tiny sizes as a smoke test (figures meaningless); the Triton checks then need TRITON_INTERPRET=1 (else
they are skipped with the reason), and bfloat16 kernel cases are skipped (the interpreter cannot do them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flotilla.bench.engine.gpu_figures import FULL, QUICK, Sizes, print_summary, ratio, verdicts

JSON_NAME = "gpu-check.json"
PNG_NAME = "gpu-check.png"
MODEL_DIR = "model"


class SkipCheck(Exception):
    """A check that cannot run here: recorded as skipped with this reason."""


@dataclass(frozen=True)
class Check:
    name: str
    title: str
    budget_s: float  # at full size on an H200; the ten minutes are their sum plus start-up
    run: Callable[[GpuRun, dict[str, Any]], str]  # fills the figures dict, returns a one-line summary


def add_bench_gpu_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help=f"folder for {JSON_NAME}, {PNG_NAME} and the model")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, e.g. on the CPU")
    parser.add_argument(
        "--skip-transformers", action="store_true", help="run the engine's side of the throughput check only"
    )
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated checks to run (default all: {', '.join(c.name for c in CHECKS)})",
    )
    parser.add_argument("--seed", type=int, default=0)


class GpuRun:
    """What the checks share: the device, the sizes, the report, and the copy bandwidth and the model
    folder once made."""

    def __init__(self, args: argparse.Namespace, log: Callable[[str], None]) -> None:
        import torch

        self.args = args
        self.log = log
        self.device = torch.device(args.device)
        self.quick: bool = args.quick
        self.sizes: Sizes = QUICK if args.quick else FULL
        # bfloat16 on CUDA; float32 on the CPU, where the engine runs float32 anyway.
        self.dtype_name = "bfloat16" if self.device.type == "cuda" else "float32"
        self.out = Path(args.out)
        self.deadline = 0.0
        self.copy: float | None = None  # GB/s, once measured
        self.model: Path | None = None  # the model folder, once written or found

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def copy_gb_per_s(self) -> float:
        """The copy bandwidth: check 1's figure, or measured now when that check did not run."""
        if self.copy is None:
            from flotilla.bench.engine.gpu_kernels import measure_copy_bandwidth

            s = self.sizes
            figures = measure_copy_bandwidth(self.device, s.copy_bytes, s.warmup, s.repeats, s.inner)
            self.copy = float(figures["gb_per_s"])
        return self.copy

    def model_folder(self) -> Path:
        """The model folder: check 4's, or written (or found) now when that check did not run."""
        if self.model is None:
            self.model = write_model(self, {})
        return self.model

    def engine(self, max_num_seqs: int, enforce_eager: bool = False):
        from flotilla.engine.config import EngineConfig
        from flotilla.engine.llm_engine import LLMEngine

        return LLMEngine(
            EngineConfig(
                model=str(self.model_folder()), device=str(self.device), dtype=self.dtype_name,
                max_num_seqs=max_num_seqs, kv_cache_memory=self.sizes.kv_cache_bytes, show_progress=False,
                seed=self.args.seed, enforce_eager=enforce_eager,
            )
        )  # fmt: skip

    def free_memory(self) -> None:
        import gc

        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


# -- the checks ----------------------------------------------------------------------------------------
def check_copy_bandwidth(run: GpuRun, fig: dict[str, Any]) -> str:
    from flotilla.bench.engine.gpu_kernels import measure_copy_bandwidth

    s = run.sizes
    fig.update(measure_copy_bandwidth(run.device, s.copy_bytes, s.warmup, s.repeats, s.inner))
    run.copy = fig["gb_per_s"]
    return f"{fig['gb_per_s']:.4g} GB/s (read + written, {s.copy_bytes / 2**20:.0f} MiB buffer)"


def check_kernels(run: GpuRun, fig: dict[str, Any]) -> str:
    from flotilla.bench.engine import gpu_kernels as gk

    reason = gk.triton_skip_reason(run.device.type)
    if reason:
        raise SkipCheck(reason)
    s = run.sizes
    cases: list[dict[str, Any]] = []
    fig["cases"] = cases
    fig["skipped_dtypes"] = {}
    todo: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    for dtype in s.kernel_dtypes:
        why = gk.dtype_skip_reason(dtype, run.device.type)
        if why:
            fig["skipped_dtypes"][dtype] = why
            continue
        for shape in s.decode_shapes:
            for lens in s.decode_lens:
                todo.append(
                    ("decode", lambda sh=shape, ln=lens, dt=dtype: gk.check_decode(sh, ln, dt, run.device))
                )
        for shape in s.prefill_shapes:
            todo.append(
                ("prefill", lambda sh=shape, dt=dtype: gk.check_prefill(sh, s.prefill_chunks, dt, run.device))
            )
        for shape in {
            (sh.block_size, sh.num_kv_heads, sh.head_dim): sh for sh in s.decode_shapes[:2]
        }.values():
            todo.append(
                ("store_kv", lambda sh=shape, dt=dtype: gk.check_store(sh, s.store_tokens, dt, run.device))
            )
    fig["planned"] = len(todo)
    for kernel, case in todo:
        if run.time_left() < 0:
            cases.append({"kernel": kernel, "skipped": "over the check's time budget"})
            continue
        try:
            cases.append(case())
        except Exception as exc:  # a compile or launch failure is a finding: record it, go on
            cases.append({"kernel": kernel, "error": f"{type(exc).__name__}: {exc}"[:2000]})
    fig["passed"] = sum(1 for c in cases if c.get("passed") is True)
    fig["failed"] = sum(1 for c in cases if c.get("passed") is False)
    fig["errors"] = sum(1 for c in cases if "error" in c)
    fig["not_run"] = sum(1 for c in cases if "skipped" in c)
    errs = [c["max_abs_err"] for c in cases if "max_abs_err" in c]
    fig["max_abs_err"] = max(errs) if errs else None
    summary = f"{fig['passed']}/{len(cases)} within tolerance, {fig['failed']} failed, {fig['errors']} errors"
    if fig["skipped_dtypes"]:
        summary += f"; skipped {', '.join(fig['skipped_dtypes'])}"
    return summary


def check_decode_attention_bandwidth(run: GpuRun, fig: dict[str, Any]) -> str:
    from flotilla.bench.engine import gpu_kernels as gk

    reason = gk.triton_skip_reason(run.device.type)
    if reason:
        raise SkipCheck(reason)
    s = run.sizes
    copy = run.copy_gb_per_s()
    fig["copy_gb_per_s"] = copy
    cases: list[dict[str, Any]] = []
    fig["cases"] = cases
    for i, shape in enumerate(s.attention):
        if i and run.time_left() < 0:
            cases.append({"name": shape.name, "skipped": "over the check's time budget"})
            continue
        case = gk.measure_decode_bandwidth(
            shape, run.device, s.warmup, s.repeats, s.inner, seed=run.args.seed
        )
        case["copy_bandwidth_ratio"] = ratio(case["gb_per_s"], copy)
        cases.append(case)
        run.free_memory()
        if i == 0:
            fig["headline"] = case["name"]
            fig["headline_gb_per_s"] = case["gb_per_s"]
            fig["headline_copy_bandwidth_ratio"] = case["copy_bandwidth_ratio"]
    return (
        f"{fig['headline']}: {fig['headline_gb_per_s']:.4g} GB/s = "
        f"{fig['headline_copy_bandwidth_ratio']:.3g} of copy"
    )


def write_model(run: GpuRun, fig: dict[str, Any]) -> Path:
    from flotilla.bench.engine.gpu_model import LLAMA_1B, LLAMA_TINY, parameter_count, write_random_llama

    shape = LLAMA_TINY if run.quick else LLAMA_1B
    folder, reused = write_random_llama(run.out / MODEL_DIR, shape, seed=run.args.seed, device=str(run.device),
                                        log=run.log)  # fmt: skip
    fig.update(
        folder=str(folder), reused=reused, name=run.sizes.model, shape=shape, parameters=parameter_count(shape),
        safetensors_bytes=(folder / "model.safetensors").stat().st_size,
    )  # fmt: skip
    return folder


def check_model(run: GpuRun, fig: dict[str, Any]) -> str:
    run.model = write_model(run, fig)
    return f"{fig['parameters'] / 1e6:,.1f}M parameters, {'reused' if fig['reused'] else 'written'}"


def _engine_facts(engine) -> dict[str, Any]:
    return {
        "attention_backend": engine.runner.backend.name,
        "engine_config": asdict(engine.config),
        "weight_bytes": engine.model_info.weight_bytes,
        "dtype": engine.model_info.dtype,
    }


def timed_request(engine, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One request alone: the time of each output token as the step loop hands it over."""
    from flotilla.bench.engine.gpu_figures import decode_tokens_per_s
    from flotilla.engine.core.sampling_params import SamplingParams

    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    token_times: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            token_times.extend([now] * len(out.new_token_ids))
    return {
        "output_tokens": len(token_times),
        "ttft_s": token_times[0] - start if token_times else None,
        "seconds": (token_times[-1] if token_times else time.perf_counter()) - start,
        "decode_tokens_per_s": decode_tokens_per_s(token_times),
    }


def check_batch1_decode(run: GpuRun, fig: dict[str, Any]) -> str:
    import statistics

    from flotilla.bench.engine.gpu_figures import bandwidth_utilization
    from flotilla.bench.engine.offline import make_workload

    s = run.sizes
    copy = run.copy_gb_per_s()
    engine = run.engine(max_num_seqs=8)
    try:
        fig.update(_engine_facts(engine))
        vocab = engine.model_config.vocab_size
        warm = make_workload(1, (16, 16), (8, 8), vocab, run.args.seed + 100)
        timed_request(engine, warm.prompts[0], 8)  # compiles the kernels for this model
        prompt_len, output_len = s.batch1_prompt_len, s.batch1_output_len
        work = make_workload(
            s.batch1_runs, (prompt_len, prompt_len), (output_len, output_len), vocab, run.args.seed
        )
        fig.update(prompt_len=s.batch1_prompt_len, output_len=s.batch1_output_len, copy_gb_per_s=copy)
        runs = fig["runs"] = []
        for prompt in work.prompts:
            runs.append(timed_request(engine, prompt, s.batch1_output_len))
        rates = [r["decode_tokens_per_s"] for r in runs if r["decode_tokens_per_s"]]
        tps = statistics.median(rates) if rates else None
        fig["decode_tokens_per_s"] = tps
        weights = engine.model_info.weight_bytes
        kv_per_token = engine.model_config.kv_bytes_per_token(engine.runner.dtype.itemsize)
        mean_context = s.batch1_prompt_len + s.batch1_output_len / 2
        fig["kv_bytes_per_step_at_mean_context"] = kv_per_token * mean_context
        if tps is None:
            raise RuntimeError("no decode rate: fewer than two output tokens")
        fig["bandwidth_utilization"] = bandwidth_utilization(weights, tps, copy)
        fig["bandwidth_utilization_with_kv"] = bandwidth_utilization(
            weights + fig["kv_bytes_per_step_at_mean_context"], tps, copy
        )
        fig["ms_per_token"] = 1e3 / tps
    finally:
        del engine
        run.free_memory()
    return (
        f"{tps:.1f} tok/s ({fig['ms_per_token']:.2f} ms/token) x {weights / 1e9:.4g} GB of weights = "
        f"{fig['bandwidth_utilization']:.3g} of copy bandwidth"
    )


def check_cuda_graphs(run: GpuRun, fig: dict[str, Any]) -> str:
    """Greedy tokens of a batch (5 requests: decode steps padded to the graph of 8) and of one request,
    with decode graphs and with --enforce-eager: identical, or the check fails. Batch-1 decode rate each
    way. Off CUDA no graph is captured: the graph path's buffers and padding run eagerly instead."""
    from flotilla.bench.engine.offline import make_workload
    from flotilla.engine.core.sampling_params import SamplingParams

    s = run.sizes
    modes: dict[str, dict[str, Any]] = {}
    for mode in ("graphs", "eager"):
        engine = run.engine(max_num_seqs=8, enforce_eager=mode == "eager")
        try:
            runner = engine.runner
            if mode == "graphs" and runner.graphs is None:
                runner.enable_decode_graphs(capture=False)
            work = make_workload(5, (8, 64), (32, 32), engine.model_config.vocab_size, run.args.seed + 200)
            params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
            tokens = [r.token_ids for r in engine.generate(work.prompts, params, use_tqdm=False)]
            tokens += [r.token_ids for r in engine.generate(work.prompts[:1], params, use_tqdm=False)]
            timed = timed_request(engine, work.prompts[0], s.batch1_output_len)
            graphs = runner.graphs
            modes[mode] = {
                "tokens": tokens,
                "decode_tokens_per_s": timed["decode_tokens_per_s"],
                "captured_sizes": sorted(graphs.graphs) if graphs else [],
            }
        finally:
            del engine
            run.free_memory()
    graphs, eager = modes["graphs"], modes["eager"]
    fig.update(
        captured_sizes=graphs["captured_sizes"],
        identical_tokens=graphs["tokens"] == eager["tokens"],
        graphs_decode_tokens_per_s=graphs["decode_tokens_per_s"],
        eager_decode_tokens_per_s=eager["decode_tokens_per_s"],
    )
    if not fig["identical_tokens"]:
        differ = [i for i, (a, b) in enumerate(zip(graphs["tokens"], eager["tokens"], strict=True)) if a != b]
        raise RuntimeError(f"greedy tokens differ with and without CUDA graphs in requests {differ}")
    g, e = graphs["decode_tokens_per_s"], eager["decode_tokens_per_s"]
    speed = f"batch-1 decode {g:.1f} tok/s with graphs, {e:.1f} without ({g / e:.2f}x)" if g and e else ""
    return f"tokens identical ({len(graphs['captured_sizes'])} graphs captured); {speed}"


def load_hf_model(folder: Path, dtype_name: str, device):
    import torch
    import transformers

    dtype = getattr(torch, dtype_name)
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # as bench offline: never stop early
    return model


def check_throughput_vs_transformers(run: GpuRun, fig: dict[str, Any]) -> str:
    from flotilla.bench.engine.hf_generate_batch import hf_generate_batch
    from flotilla.bench.engine.offline import (
        Workload,
        hf_sequential,
        hf_static_batches,
        make_workload,
        run_engine,
    )

    s = run.sizes
    engine = run.engine(max_num_seqs=s.max_num_seqs)
    try:
        fig.update(_engine_facts(engine))
        vocab = engine.model_config.vocab_size
        work = make_workload(s.num_prompts, s.input_len, (s.output_len, s.output_len), vocab, run.args.seed)
        warm = make_workload(4, s.input_len, (8, 8), vocab, run.args.seed + 100)
        fig["workload"] = {
            "num_prompts": s.num_prompts, "input_len": list(s.input_len), "output_len": s.output_len,
            "max_num_seqs": s.max_num_seqs, "prompt_tokens": sum(map(len, work.prompts)),
            "output_tokens": work.output_tokens,
        }  # fmt: skip
        run.log("bench gpu:   (c) flotilla ...")
        run_engine(engine, warm)
        fig["flotilla"] = run_engine(engine, work)
    finally:
        del engine
        run.free_memory()
    ours = fig["flotilla"]["tokens_per_s"]
    summary = f"flotilla {ours:.0f} tok/s"
    if run.args.skip_transformers:
        fig["transformers"] = "skipped (--skip-transformers)"
        return summary + "; transformers skipped"
    model = load_hf_model(run.model_folder(), run.dtype_name, run.device)
    try:
        import transformers

        fig["transformers"] = transformers.__version__
        hf_sequential(model, Workload([[9, 10, 11, 12]], [4]))  # warm-up
        subset = Workload(
            work.prompts[: s.hf_sequential_prompts], work.output_lens[: s.hf_sequential_prompts]
        )
        run.log(
            f"bench gpu:   (a) transformers generate, one request at a time ({len(subset.prompts)} prompts) ..."
        )
        fig["hf_sequential"] = {**hf_sequential(model, subset), "prompts_measured": len(subset.prompts)}
        fig["speedup_vs_hf_sequential"] = ratio(ours, fig["hf_sequential"]["tokens_per_s"])
        run.log(f"bench gpu:   (b) transformers generate, static batches of {s.max_num_seqs} ...")
        fig["hf_static_batch"] = hf_static_batches(model, work, s.max_num_seqs)
        fig["speedup_vs_hf_static_batch"] = ratio(ours, fig["hf_static_batch"]["tokens_per_s"])
        run.log("bench gpu:   (d) transformers generate_batch (continuous batching) ...")
        cb = s.hf_continuous_batching
        warm_gb = hf_generate_batch(model, warm.prompts, warm.output_lens, cb)
        if warm_gb["available"]:
            gb = hf_generate_batch(model, work.prompts, work.output_lens, cb)
            fig["hf_generate_batch"] = gb
            fig["speedup_vs_hf_generate_batch"] = ratio(ours, gb["best_tokens_per_s"])
        else:
            fig["hf_generate_batch"] = warm_gb
    finally:
        del model
        run.free_memory()
    summary += f"; {fig['speedup_vs_hf_sequential']:.1f}x generate one at a time"
    summary += f", {fig['speedup_vs_hf_static_batch']:.2f}x static batches"
    if fig.get("speedup_vs_hf_generate_batch") is not None:
        summary += f", {fig['speedup_vs_hf_generate_batch']:.2f}x generate_batch"
    else:
        summary += f"; generate_batch: {fig['hf_generate_batch']['reason']}"
    return summary


CHECKS: tuple[Check, ...] = (
    Check("copy_bandwidth", "device-to-device copy bandwidth", 20, check_copy_bandwidth),
    Check("kernels", "Triton kernels vs the torch reference", 130, check_kernels),
    Check(
        "decode_attention_bandwidth",
        "decode attention bandwidth vs copy",
        40,
        check_decode_attention_bandwidth,
    ),
    Check("model", "the random ~1B Llama folder", 60, check_model),
    Check("batch1_decode", "batch-1 decode bandwidth utilisation", 60, check_batch1_decode),
    Check("cuda_graphs", "decode with and without CUDA graphs", 50, check_cuda_graphs),
    Check("throughput_vs_transformers", "throughput vs transformers", 180, check_throughput_vs_transformers),
)


# -- the command ---------------------------------------------------------------------------------------
def environment(device) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "device": str(device),
        "device_type": device.type,
        "device_name": platform.processor() or platform.machine() or "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception as exc:  # recorded, not fatal: a check that needs it fails on its own
            env[name] = f"unavailable: {exc}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name, capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count, memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
        )  # fmt: skip
    return env


def write_json(path: Path, report: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(partial, path)


def run_bench_gpu(args: argparse.Namespace) -> int:
    import torch

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / JSON_NAME
    selected = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = selected - {c.name for c in CHECKS}
    if unknown:
        log(
            f"bench gpu: unknown checks {', '.join(sorted(unknown))}; choose from {', '.join(c.name for c in CHECKS)}"
        )
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log(
            "bench gpu: --device cuda, but torch sees no CUDA device (use --quick --device cpu for a smoke run)"
        )
        return 2
    run = GpuRun(args, log)
    report: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool)},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": run.quick,
        "environment": environment(device),
        "dtype": run.dtype_name,
        "sizes": asdict(run.sizes),
        "checks": {c.name: {"title": c.title, "status": "pending", "budget_s": c.budget_s} for c in CHECKS},
    }
    report["verdicts"] = verdicts(report["checks"])
    write_json(json_path, report)
    started = time.monotonic()
    for i, check in enumerate(CHECKS, 1):
        entry = report["checks"][check.name]
        if selected and check.name not in selected:
            entry.update(status="skipped", reason="not selected (--only)")
        else:
            log(f"bench gpu: [{i}/{len(CHECKS)}] {check.title} (budget {check.budget_s:.0f} s) ...")
            t0 = time.monotonic()
            run.deadline = t0 + check.budget_s
            figures: dict[str, Any] = {}
            try:
                summary = check.run(run, figures)
                entry.update(status="ok", summary=summary)
            except SkipCheck as exc:
                entry.update(status="skipped", reason=str(exc))
            except Exception as exc:  # recorded; the next check still runs
                entry.update(
                    status="error",
                    error=f"{type(exc).__name__}: {exc}"[:2000],
                    traceback=traceback.format_exc()[-6000:],
                )
            finally:
                run.free_memory()
            entry.update(figures)
            entry["seconds"] = time.monotonic() - t0
            entry["over_budget"] = entry["seconds"] > check.budget_s
            detail = entry.get("summary") or entry.get("reason") or entry.get("error")
            log(f"bench gpu: {check.name}: {entry['status']} in {entry['seconds']:.1f} s: {detail}")
        report["verdicts"] = verdicts(report["checks"])
        report["seconds"] = time.monotonic() - started
        write_json(json_path, report)
    png_path = out / PNG_NAME
    try:
        from flotilla.bench.engine.gpu_figures import plot

        plot(report, str(png_path))
        report["png"] = str(png_path)
    except Exception as exc:  # the JSON stands without the picture
        report["png_error"] = f"{type(exc).__name__}: {exc}"
    write_json(json_path, report)
    print_summary(report)
    log(f"bench gpu: wrote {json_path}" + (f" and {png_path}" if "png" in report else ""))
    return 1 if any(entry["status"] == "error" for entry in report["checks"].values()) else 0
