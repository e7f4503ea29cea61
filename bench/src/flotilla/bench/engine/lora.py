"""`flotilla engine bench lora`: what serving LoRA adapters costs, on one model folder.

Output tok/s of one batch (the same token-id prompts, greedy, fixed output lengths) when every request
runs on the base model, and when the requests are spread round-robin over 1, 4 and 8 adapters (all loaded,
`--max-loras` = the most adapters measured, so every adapter has a slot). The runs take turns, round after
round, so that a machine whose speed drifts slows them alike; each ratio to the base is the median of the
per-round ratios. Also: the memory one active adapter takes (its device slot, sized for `--max-lora-rank`,
and its host copy), and the time from loading an adapter to its first token (read, check and register
the folder, then one request). The adapters are random, written in PEFT's format on every decoder linear
layer. Prints the table (progress on stderr), writes --json and --png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flotilla.contract import parse_positive_count, parse_positive_counts
from flotilla.engine.engine_args import argparse_type

TARGET_AT_8 = 0.8  # output tok/s at 8 adapters against the base alone (the CPU target)


def add_bench_lora_args(parser: argparse.ArgumentParser) -> None:
    count = argparse_type(parse_positive_count)
    parser.add_argument("--model", required=True, help="model folder (e.g. from `flotilla model init`)")
    parser.add_argument(
        "--adapters", type=argparse_type(parse_positive_counts), default=[1, 4, 8],
        help="adapter counts to spread the batch over (default 1,4,8)",
    )  # fmt: skip
    parser.add_argument("--rank", type=count, default=16, help="the adapters' rank (default 16)")
    parser.add_argument("--num-prompts", type=count, default=32, help="requests in the batch (default 32)")
    parser.add_argument("--input-len", type=count, default=128, help="prompt tokens each (default 128)")
    parser.add_argument("--output-len", type=count, default=64, help="output tokens each (default 64)")
    parser.add_argument("--rounds", type=count, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--png", help="write the figure to this PNG")


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def write_random_adapter(folder: Path, config, rank: int, seed: int) -> None:
    """A PEFT LoRA folder on every decoder linear layer, random A and small random B."""
    import torch

    from flotilla.engine.model import hf_names
    from flotilla.engine.model.synthetic.weights_file import save_weights_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (out_f, in_f) in hf_names.linear_shapes(config).items():
            a = torch.randn(rank, in_f, generator=generator) / in_f**0.5
            b = torch.randn(out_f, rank, generator=generator) * 0.01
            tensors[hf_names.peft_lora_name(layer, module, hf_names.LORA_A)] = a
            tensors[hf_names.peft_lora_name(layer, module, hf_names.LORA_B)] = b
    folder.mkdir(parents=True, exist_ok=True)
    save_weights_file(tensors, folder / "adapter_model.safetensors")
    targets = list(hf_names.LORA_TARGETS)
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets})
    )


def run_lora_bench(args: argparse.Namespace) -> int:
    from flotilla.bench.engine.lora_figures import format_report, write_png
    from flotilla.engine.config import EngineConfig
    from flotilla.engine.core.sampling_params import SamplingParams
    from flotilla.engine.llm_engine import LLMEngine
    from flotilla.engine.model.config import ModelConfig

    model_config = ModelConfig.from_file(Path(args.model) / "config.json")
    most = max(args.adapters)
    with tempfile.TemporaryDirectory(prefix="flotilla-lora-bench-") as tmp:
        _progress(f"writing {most + 1} random adapters of rank {args.rank}")
        folders = [Path(tmp) / f"adapter-{i}" for i in range(most + 1)]
        for i, folder in enumerate(folders):
            write_random_adapter(folder, model_config, args.rank, seed=i)
        _progress("loading the engine")
        engine = LLMEngine(
            EngineConfig(
                model=args.model, device=args.device, dtype=args.dtype, cpu_threads=args.threads,
                show_progress=False, max_num_seqs=args.num_prompts, enable_lora=True, max_loras=most,
                max_lora_rank=args.rank, max_cpu_loras=most + 1,
                lora_modules={f"a{i}": str(folders[i]) for i in range(most)},
            )
        )  # fmt: skip
        rng = random.Random(0)
        vocab = model_config.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        cases = [0, *args.adapters]

        def run(num_adapters: int) -> float:
            names = [None if num_adapters == 0 else f"a{i % num_adapters}" for i in range(len(prompts))]
            start = time.perf_counter()
            for prompt, name in zip(prompts, names, strict=True):
                engine.add_request(prompt, params, lora_name=name)
            tokens = 0
            while engine.has_unfinished_requests():
                tokens += sum(len(out.new_token_ids) for out in engine.step())
            elapsed = time.perf_counter() - start
            engine.kv_manager.reset_prefix_cache()  # every run prefills its prompts
            return tokens / elapsed

        run(cases[-1])  # warm-up: every slot filled once, allocator and caches touched
        rates: dict[int, list[float]] = {case: [] for case in cases}
        for round_ in range(args.rounds):
            _progress(f"round {round_ + 1}/{args.rounds}")
            for case in cases:
                rates[case].append(run(case))
        ratios = {
            case: statistics.median(r / b for r, b in zip(rates[case], rates[0], strict=True))
            for case in cases
        }
        load_start = time.perf_counter()
        engine.load_lora("fresh", str(folders[most]))
        loaded = time.perf_counter() - load_start
        engine.add_request(
            prompts[0], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), lora_name="fresh"
        )
        while engine.has_unfinished_requests():
            engine.step()
        first_token = time.perf_counter() - load_start
        assert engine.loras is not None and engine.runner.lora_weights is not None
        report: dict[str, Any] = {
            "model": args.model,
            "device": engine.resolved.device,
            "dtype": engine.resolved.dtype,
            "threads": args.threads,
            "rank": args.rank,
            "prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "rounds": args.rounds,
            "rows": [
                {
                    "adapters": case,
                    "tok_s": statistics.median(rates[case]),
                    "tok_s_per_round": rates[case],
                    "ratio_to_base": ratios[case],
                }
                for case in cases
            ],  # fmt: skip
            "slot_bytes": engine.runner.lora_weights.slot_bytes,
            "adapter_host_bytes": engine.loras.get("fresh").nbytes,
            "load_seconds": loaded,
            "load_to_first_token_seconds": first_token,
            "target_ratio_at_8": TARGET_AT_8,
        }
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        _progress(f"wrote {args.json}")
    if args.png:
        write_png(report, args.png)
        _progress(f"wrote {args.png}")
    return 0
