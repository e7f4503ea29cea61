"""The engine's command-line flags, shared by `flotilla engine serve` and the benchmarks, and their
mapping onto EngineConfig. Import-light: no torch."""

from __future__ import annotations

import argparse

from flotilla.contract import (
    FLAG_BLOCK_SIZE,
    FLAG_DTYPE,
    FLAG_KV_CACHE_MEMORY,
    FLAG_MAX_NUM_BATCHED_TOKENS,
    FLAG_MAX_NUM_SEQS,
    FLAG_MODEL,
    FLAG_NO_PREFIX_CACHING,
    FLAG_NUM_SPECULATIVE_TOKENS,
    FLAG_QUANTIZATION,
    FLAG_QUANTIZATION_GROUP_SIZE,
    FLAG_SCHEDULING_POLICY,
    FLAG_SPECULATIVE_MAX_BATCH_SIZE,
    FLAG_SPECULATIVE_METHOD,
    FLAG_SPECULATIVE_MODEL,
    FLAG_TENANT_WEIGHTS,
    MAX_SPECULATIVE_TOKENS,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    parse_tenant_weights,
)
from flotilla.engine.config import ATTENTION_BACKENDS, EngineConfig
from flotilla.quantity import parse_byte_size


def parse_bytes(text: str) -> int:
    """A size flag: '4GiB', '512MiB', '1e9' or a plain number of bytes (flotilla.quantity.parse_byte_size)."""
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def whole_number(text: str, minimum: int, rule: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
    return value


def thread_count(text: str) -> int:
    """--threads: 0 (the default count) or more."""
    return whole_number(text, 0, "0 (the default count) or more")


def positive_count(text: str) -> int:
    """A count of at least 1 (prompts, tokens, repeats)."""
    return whole_number(text, 1, "1 or more")


def positive_counts(text: str) -> list[int]:
    """Comma-separated counts of at least 1, e.g. 1,32."""
    try:
        return [positive_count(part) for part in text.split(",")]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def tenant_weights(text: str) -> dict[str, float]:
    """--tenant-weights: tenant=weight,tenant=weight (flotilla.contract's format)."""
    try:
        return parse_tenant_weights(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig(model="")
    group = parser.add_argument_group("engine")
    group.add_argument(FLAG_MODEL, required=True, help="a local Hugging Face model folder")
    group.add_argument(FLAG_DTYPE, default=defaults.dtype, help="auto, bfloat16, float16 or float32")
    group.add_argument("--device", default=defaults.device, help="auto, cpu or cuda[:N]")
    group.add_argument(FLAG_BLOCK_SIZE, type=int, default=defaults.block_size, help="tokens per KV block")
    group.add_argument(
        FLAG_MAX_NUM_SEQS, type=int, default=defaults.max_num_seqs, help="most requests in one batch"
    )
    group.add_argument(
        FLAG_MAX_NUM_BATCHED_TOKENS,
        type=int,
        default=defaults.max_num_batched_tokens,
        help="token budget of one step (prefill chunks included)",
    )
    group.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    group.add_argument(
        FLAG_KV_CACHE_MEMORY,
        type=parse_bytes,
        default=None,
        help="bytes for the KV cache, e.g. 2GiB (default: 1 GiB on CPU, "
        "--gpu-memory-utilization of free memory on CUDA)",
    )
    group.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    group.add_argument(
        FLAG_NO_PREFIX_CACHING, action="store_true", help="turn off prefix caching of KV blocks"
    )
    group.add_argument(
        "--attention-backend",
        default=defaults.attention_backend,
        choices=ATTENTION_BACKENDS,
        help="auto: triton on CUDA; on the CPU, cpu (a decode kernel compiled on first use) for float32 "
        "where a C compiler is found, else torch",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: run every decode step kernel by kernel (graphs are CUDA-only)",
    )
    group.add_argument(
        "--cuda-graph-sizes",
        type=positive_counts,
        default=None,
        help="decode batch sizes to capture as CUDA graphs, e.g. 1,2,4,8,16 (default: 1, 2, 4, 8, then "
        "every 16 up to 256 or --max-num-seqs); a larger batch runs without a graph",
    )
    group.add_argument(
        FLAG_SCHEDULING_POLICY,
        choices=SCHEDULING_POLICIES,
        default=defaults.scheduling_policy,
        help="the order requests are admitted and preempted in: fcfs (arrival), priority (the "
        "request's priority, then arrival) or fair (the tenant served least so far, weighted by "
        f"{FLAG_TENANT_WEIGHTS}; the virtual token counter) (default {defaults.scheduling_policy})",
    )
    group.add_argument(
        FLAG_TENANT_WEIGHTS,
        type=tenant_weights,
        default={},
        metavar="TENANT=WEIGHT,...",
        help="fair-share weights, e.g. team-a=2,team-b=1: a tenant of weight 2 gets twice the tokens of "
        "one of weight 1 when both wait (default: every tenant weighs 1)",
    )
    add_quantization_args(group, defaults)
    add_speculative_args(group, defaults)
    group.add_argument("--seed", type=int, default=defaults.seed)
    group.add_argument(
        "--threads",
        type=thread_count,
        default=defaults.cpu_threads,
        help="torch CPU threads (0: all cores but one when serving, torch's default otherwise)",
    )


def add_quantization_args(group, defaults: EngineConfig | None = None) -> None:
    """--quantization and --quantization-group-size (also declared by `bench offline`)."""
    defaults = defaults or EngineConfig(model="")
    group.add_argument(
        FLAG_QUANTIZATION,
        choices=QUANTIZATION_METHODS,
        default=defaults.quantization,
        help="weight-only quantization of the decoder's linear layers at load time, from the float "
        "checkpoint: int8 (per output channel) or int4 (per group of input features); embeddings, norms "
        f"and the LM head stay in float (default {defaults.quantization})",
    )
    group.add_argument(
        FLAG_QUANTIZATION_GROUP_SIZE,
        type=int,
        choices=QUANTIZATION_GROUP_SIZES,
        default=defaults.quantization_group_size,
        help="int4: input features per scale; must divide every quantized layer's input features "
        f"(default {defaults.quantization_group_size})",
    )


def add_speculative_args(group, defaults: EngineConfig | None = None) -> None:
    """The speculative-decoding flags (also declared by `bench offline`). Values are checked by
    EngineConfig, which names the flag, the value and the rule."""
    defaults = defaults or EngineConfig(model="")
    group.add_argument(
        FLAG_SPECULATIVE_METHOD,
        default=defaults.speculative_method,
        metavar="{" + ",".join(SPECULATIVE_METHODS) + "}",
        help="speculative decoding: ngram (drafts looked up in the request's own tokens) or draft (a "
        f"smaller model, {FLAG_SPECULATIVE_MODEL}); the output distribution stays the model's. Requests with "
        f"logprobs or penalties decode without it (default {defaults.speculative_method})",
    )
    group.add_argument(
        FLAG_NUM_SPECULATIVE_TOKENS,
        type=int,
        default=defaults.num_speculative_tokens,
        help=f"drafts verified per step, 1 to {MAX_SPECULATIVE_TOKENS} (default {defaults.num_speculative_tokens})",
    )
    group.add_argument(
        FLAG_SPECULATIVE_MODEL,
        default=defaults.speculative_model,
        help="the draft model's folder: same tokenizer and vocabulary as --model",
    )
    group.add_argument(
        FLAG_SPECULATIVE_MAX_BATCH_SIZE,
        type=int,
        default=defaults.speculative_max_batch_size,
        help="speculate only in steps that run at most this many requests: a full batch is compute-bound, "
        f"and verifying drafts there costs more than it saves (default {defaults.speculative_max_batch_size})",
    )


def engine_config_from_args(args: argparse.Namespace, show_progress: bool = False) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend=args.attention_backend,
        seed=args.seed,
        cpu_threads=args.threads,
        show_progress=show_progress,
        scheduling_policy=args.scheduling_policy,
        tenant_weights=dict(args.tenant_weights),
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_model=args.speculative_model,
        speculative_max_batch_size=args.speculative_max_batch_size,
        enforce_eager=args.enforce_eager,
        cuda_graph_sizes=args.cuda_graph_sizes,
    )
