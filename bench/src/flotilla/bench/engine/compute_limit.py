"""How close `bench offline` runs to what this machine's matmuls allow, and where a step's time goes.

- `model_flops_per_token`: 2 x the weights of the linear layers every token passes through (attention's
  q/k/v/o projections and the MLP's gate/up/down in each layer, then the LM head). Embeddings are a lookup
  and count nothing; biases, norms, RoPE and activations are a few FLOPs per element and count nothing.
  Attention's own FLOPs (q.k and p.v over the context: 4 x layers x heads x head_dim per context token)
  are excluded, because they grow with the context: at the bench's lengths (a few hundred tokens) they
  add a few percent, reported apart as `attention_flops_per_token`.
- `matmul_gflops`: the rate of the model's own linear layers (its weights, dtype, device and the run's
  thread count) on M tokens at once, best of a few repeats, layers weighted as one forward runs them.
- `compute_limit_tokens_per_s` = matmul FLOP/s / model_flops_per_token: output tokens per second if a
  step were nothing but its linear layers at that rate; `compute_limit_ratio` = the run's output tokens
  per second / that limit. Prompt tokens cost linear FLOPs too (prefill) but are not counted in the
  ratio; `linear_flops_utilization` counts them: every token's linear FLOPs over the run's time, over
  the matmul rate.
- `step_breakdown`: a CPU torch.profiler trace of a few decode steps, self time grouped into linear
  layers, attention (everything under ATTENTION_LABEL), sampling (under SAMPLER_LABEL), other torch ops
  and, from the steps' wall time less all profiled op time, Python (scheduler, input building, outputs).
  On CUDA the op times are launch times, not kernel times.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from flotilla.engine.kernels.attention import ATTENTION_LABEL
from flotilla.engine.kernels.linear import ONEDNN_LINEAR_OP
from flotilla.engine.model import hf_names
from flotilla.engine.model.config import ModelConfig
from flotilla.engine.worker.sampler import SAMPLER_LABEL


# -- FLOPs ---------------------------------------------------------------------------------------------
def linear_shapes(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
    """(name, in_features, out_features, uses per token) of each linear layer, fused as the model runs
    them (q/k/v in one matmul, gate/up in one)."""
    layers = [(hf_names.short(name), k, n, cfg.num_hidden_layers) for name, k, n in cfg.decoder_linears()]
    return [*layers, (hf_names.LM_HEAD, cfg.hidden_size, cfg.vocab_size, 1)]


def model_flops_per_token(cfg: ModelConfig) -> int:
    """2 x the linear-layer weights one token passes through, LM head included (a multiply and an add
    per weight). Excludes embeddings, biases, norms and attention's own context-dependent FLOPs."""
    return 2 * sum(k * n * uses for _, k, n, uses in linear_shapes(cfg))


def lm_head_flops_per_token(cfg: ModelConfig) -> int:
    return 2 * cfg.hidden_size * cfg.vocab_size


def attention_flops_per_token(cfg: ModelConfig, context_len: float) -> float:
    """q.k and p.v of one new token against context_len tokens, in every layer and query head."""
    return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context_len


def mean_decode_context(prompt_lens: Iterable[int], output_lens: Iterable[int]) -> float:
    """The mean context an output token attends to: the i-th output (from 1) of a prompt of p tokens
    sees p + i - 1 tokens."""
    total, count = 0, 0
    for p, n in zip(prompt_lens, output_lens, strict=True):
        total += n * p + n * (n - 1) // 2
        count += n
    return total / count if count else 0.0


# -- the matmul rate -----------------------------------------------------------------------------------
def model_linears(model, cfg: ModelConfig) -> list[tuple[str, Any, int]]:
    """(name, module, uses per token) of the model's linear layers, the first decoder layer's standing
    for all of them; checked against linear_shapes."""
    modules = {hf_names.short(name): model.model.get_submodule(name) for name, _, _ in cfg.decoder_linears()}
    modules[hf_names.LM_HEAD] = model.get_submodule(hf_names.LM_HEAD)
    out = []
    for name, k, n, uses in linear_shapes(cfg):
        module = modules[name]
        if (module.in_features, module.out_features) != (k, n):
            raise ValueError(f"{name} is {module.in_features}x{module.out_features}, the config says {k}x{n}")
        out.append((name, module, uses))
    return out


def best_time(fn: Callable[[], object], sync: Callable[[], None], repeats: int, budget_s: float) -> float:
    """The fastest of up to `repeats` timed calls (at least 2) after one warm-up, stopping early once
    budget_s is spent."""
    fn()
    sync()
    times: list[float] = []
    spent = 0.0
    while len(times) < 2 or (len(times) < repeats and spent < budget_s):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return min(times)


def measure_matmul(
    linears: list[tuple[str, Any, int]],
    batch_tokens: Iterable[int] = (64, 256),
    repeats: int = 5,
    budget_s: float = 0.2,
    log: Callable[[str], None] = lambda _msg: None,
) -> dict[str, Any]:
    """GFLOP/s of the given linear layers on M random tokens, for each M; `matmul_gflops` is the best M.
    At each M the layers are weighted by their uses per token, so the rate is one forward's linear
    work over its time."""
    import torch

    # The layers' input dtype and device: a float weight's (quantized layers hold none; the LM head does).
    weight = next(m.weight for _, m, _ in linears if isinstance(getattr(m, "weight", None), torch.Tensor))
    device, dtype = weight.device, weight.dtype
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    by_batch = []
    with torch.inference_mode():
        for m in batch_tokens:
            flops, seconds, per_layer = 0, 0.0, {}
            for name, module, uses in linears:
                x = torch.randn(m, module.in_features, dtype=dtype, device=device)
                t = best_time(lambda module=module, x=x: module(x), sync, repeats, budget_s)
                f = 2 * m * module.in_features * module.out_features
                per_layer[name] = f / t / 1e9
                flops, seconds = flops + f * uses, seconds + t * uses
            by_batch.append({"batch_tokens": m, "gflops": flops / seconds / 1e9, "layer_gflops": per_layer})
            log(f"bench: matmul rate at {m} tokens: {flops / seconds / 1e9:.1f} GFLOP/s")
    best = max(by_batch, key=lambda r: r["gflops"])
    return {
        "matmul_gflops": best["gflops"],
        "matmul_batch_tokens": best["batch_tokens"],
        "matmul_by_batch": by_batch,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).replace("torch.", ""),
    }


def compute_limit(
    cfg: ModelConfig, matmul: dict[str, Any], run: dict[str, Any], prompt_tokens: int, mean_context: float
) -> dict[str, Any]:
    """The limit and the ratio from the matmul rate and a timed run (`run_engine`'s figures)."""
    flops = model_flops_per_token(cfg)
    rate = matmul["matmul_gflops"] * 1e9
    limit = rate / flops
    # Every prompt token runs the layers but (the last one aside, counted as an output) not the LM head.
    linear_work = run["output_tokens"] * flops + prompt_tokens * (flops - lm_head_flops_per_token(cfg))
    return {
        "tokens_per_s": run["tokens_per_s"],
        "tokens_counted": "output",
        "model_flops_per_token": flops,
        "attention_flops_per_token": attention_flops_per_token(cfg, mean_context),
        "mean_decode_context": mean_context,
        **matmul,
        "compute_limit_tokens_per_s": limit,
        "compute_limit_ratio": run["tokens_per_s"] / limit,
        "linear_flops_utilization": linear_work / run["seconds"] / rate,
    }


# -- the step breakdown --------------------------------------------------------------------------------
LINEAR_OPS = frozenset(
    {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm", ONEDNN_LINEAR_OP}
)
CATEGORIES = ("linear", "attention", "sampling", "other_ops", "python")


@dataclass(frozen=True)
class ProfileRow:
    """One profiled op or labelled range: its self CPU time and the names of the ranges around it,
    innermost first."""

    name: str
    self_us: float
    parents: tuple[str, ...] = ()


def category(row: ProfileRow) -> str:
    path = (row.name, *row.parents)
    if ATTENTION_LABEL in path:
        return "attention"
    if SAMPLER_LABEL in path:
        return "sampling"
    if any(name in LINEAR_OPS for name in path):
        return "linear"
    return "other_ops"


def group_profile(rows: Iterable[ProfileRow], wall_s: float) -> dict[str, Any]:
    """Seconds and shares per category; `python` is the wall time no profiled op accounts for."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for row in rows:
        seconds[category(row)] += row.self_us / 1e6
    profiled = sum(seconds.values())
    seconds["python"] = max(0.0, wall_s - profiled)
    total = max(wall_s, profiled)
    return {
        "wall_s": wall_s,
        "seconds": seconds,
        "shares": {k: v / total if total else 0.0 for k, v in seconds.items()},
    }


def rows_from_events(events) -> list[ProfileRow]:
    """ProfileRows from torch.profiler's FunctionEvents (their cpu_parent links)."""
    rows = []
    for event in events:
        parents = []
        parent = event.cpu_parent
        while parent is not None:
            parents.append(parent.name)
            parent = parent.cpu_parent
        rows.append(ProfileRow(event.name, float(event.self_cpu_time_total), tuple(parents)))
    return rows


def profile_steps(engine, prompts: list[list[int]], output_lens: list[int], steps: int) -> dict[str, Any]:
    """Adds the requests, steps until every one is decoding, profiles up to `steps` steps, then aborts
    what is left. The breakdown is of decode steps at the full batch, the bulk of a decode-heavy run."""
    from torch.profiler import ProfilerActivity, profile

    # Kineto's log level is read when profiling starts: keep its "gpuGetDeviceCount failed" line off a CPU run.
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")

    from flotilla.engine.core.sampling_params import SamplingParams

    requests = [
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, output_lens, strict=True)
    ]
    sched = engine.scheduler

    def prefilling() -> bool:
        return bool(sched.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)

    while engine.has_unfinished_requests() and prefilling():
        engine.step()
    running = sched.num_running
    walls: list[float] = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while len(walls) < steps and engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    for request in requests:
        engine.abort(request.request_id)
    result = group_profile(rows_from_events(prof.events()), sum(walls))
    return {
        "steps": len(walls),
        "running_sequences": running,
        "ms_per_step": 1e3 * sum(walls) / len(walls) if walls else 0.0,
        **result,
    }
