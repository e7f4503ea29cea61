"""One system's process in `flotilla engine bench offline --compare vllm`: it loads Flotilla's LLMEngine or
vLLM's LLM on the model, then runs the whole workload each time it is asked and answers with the time it
took and the tokens. The same code times both systems.

Stdlib only at module level: vLLM's python runs this file by its path (it has no Flotilla), Flotilla's
runs it as `python -m flotilla.bench.engine.offline_peer`.

The protocol: argv[1] is a job file (JSON: `system`, `settings`, `workloads`: a list of `{"prompts",
"output_lens"}`). The peer answers with one JSON object per line on its standard output, `{"event":
"ready", ...}` first, and reads one command per line on its standard input: `{"cmd": "run", "workload":
N}` (answered by `{"event": "ran", "seconds", "output_tokens", "token_ids"}`) or `{"cmd": "quit"}`. A
failure is `{"event": "error", "message"}`. What the libraries print goes to standard error."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

WARMUP_PROMPTS = [[9, 10, 11, 12, 13, 14, 15, 16], [17, 18, 19, 20]]
WARMUP_TOKENS = 8


class Flotilla:
    name = "flotilla"

    def __init__(self, settings: dict[str, Any]) -> None:
        from flotilla.engine.config import EngineConfig
        from flotilla.engine.llm_engine import LLMEngine

        self.settings = settings
        self.engine = LLMEngine(
            EngineConfig(
                model=settings["model"], device="cpu", dtype=settings["dtype"],
                block_size=settings["block_size"], max_num_seqs=settings["max_num_seqs"],
                max_num_batched_tokens=settings["max_num_batched_tokens"],
                kv_cache_memory=settings["kv_cache_bytes"], enable_prefix_caching=settings["prefix_caching"],
                cpu_threads=len(settings["cpus"]), seed=settings["seed"], show_progress=False,
            )
        )  # fmt: skip

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        from flotilla.engine.core.sampling_params import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        return [list(out.token_ids or []) for out in self.engine.generate(prompts, params, use_tqdm=False)]

    def info(self) -> dict[str, Any]:
        import importlib.metadata

        import torch

        runner = self.engine.runner
        return {
            "version": importlib.metadata.version("flotilla-engine"),
            "torch": torch.__version__,
            "dtype": str(runner.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(),
            "block_size": self.engine.config.block_size,
            "kv_cache_blocks": runner.num_blocks,
            "kv_cache_tokens": runner.num_blocks * self.engine.config.block_size,
            "max_model_len": self.engine.max_model_len,
        }

    def close(self) -> None:
        del self.engine


class Vllm:
    name = "vllm"

    def __init__(self, settings: dict[str, Any]) -> None:
        vllm = importlib.import_module("vllm")  # not a static import: vLLM is no dependency of Flotilla
        self.vllm = vllm
        self.llm = vllm.LLM(
            model=settings["model"], dtype=settings["dtype"], block_size=settings["vllm_block_size"],
            max_num_seqs=settings["max_num_seqs"], max_num_batched_tokens=settings["max_num_batched_tokens"],
            kv_cache_memory_bytes=settings["kv_cache_bytes"], enable_prefix_caching=settings["prefix_caching"],
            seed=settings["seed"],
        )  # fmt: skip

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        params = [
            self.vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens
        ]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def info(self) -> dict[str, Any]:
        import torch

        config = self.llm.llm_engine.vllm_config
        cache = config.cache_config
        blocks = getattr(cache, "num_gpu_blocks", None)
        return {
            "version": self.vllm.__version__,
            "torch": torch.__version__,
            "dtype": str(config.model_config.dtype).replace("torch.", ""),
            "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "block_size": cache.block_size,
            "kv_cache_blocks": blocks,
            "kv_cache_tokens": blocks * cache.block_size if blocks else None,
            "max_model_len": config.model_config.max_model_len,
            "compilation_mode": str(getattr(config.compilation_config, "mode", None)),
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
        }

    def close(self) -> None:
        del self.llm


SYSTEMS: dict[str, Callable[[dict[str, Any]], Any]] = {"flotilla": Flotilla, "vllm": Vllm}


def answer_channel() -> TextIO:
    """The protocol's stream: the original standard output. Descriptor 1 becomes standard error, so that
    whatever the libraries print (vLLM logs to stdout) cannot reach the parent as an answer."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return channel


def run(job: dict[str, Any], commands: TextIO, send: Callable[[dict[str, Any]], None]) -> None:
    settings = job["settings"]
    os.sched_setaffinity(0, settings["cpus"])  # children (vLLM's engine core) inherit it
    start = time.perf_counter()
    system = SYSTEMS[job["system"]](settings)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    system.generate(WARMUP_PROMPTS, [WARMUP_TOKENS] * len(WARMUP_PROMPTS))
    send({"event": "ready", "load_s": load_s, "warmup_s": time.perf_counter() - start, "info": system.info()})
    workloads = job["workloads"]
    try:
        for line in commands:
            command = json.loads(line)
            if command.get("cmd") == "quit":
                return
            if command.get("cmd") != "run":
                send({"event": "error", "message": f"unknown command {command!r}"})
                continue
            work = workloads[command["workload"]]
            start = time.perf_counter()
            token_ids = system.generate(work["prompts"], work["output_lens"])
            seconds = time.perf_counter() - start
            output_tokens = sum(map(len, token_ids))
            send({"event": "ran", "seconds": seconds, "output_tokens": output_tokens, "token_ids": token_ids})
    finally:
        system.close()


def main(argv: list[str]) -> int:
    channel = answer_channel()

    def send(message: dict[str, Any]) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    try:
        with open(argv[1]) as f:
            job = json.load(f)
        run(job, sys.stdin, send)
    except BaseException as exc:  # the parent reads the reason; the traceback goes to the log
        traceback.print_exc()
        send({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    return 0


if __name__ == "__main__":  # vLLM's engine core starts by spawning: nothing runs on import
    sys.exit(main(sys.argv))
