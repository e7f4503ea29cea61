"""The kernel checks of `flotilla engine bench gpu`: the device's copy bandwidth, the Triton kernels against
the torch reference on the device, and the decode kernel's bandwidth.

- Timing: on CUDA, torch.cuda.Event pairs around `inner` back-to-back calls (so the launch gap of one call
  hides behind the previous call's kernel), after warm-up calls; a figure is the median over `repeats`
  such samples, per call. The decode kernel is also timed as replays of a CUDA graph of `inner` calls
  (no launch gaps at all, which matters for small cases such as one request) and that figure is used
  when the capture works; the eager one is kept beside it. On the CPU, the host clock the same way
  (meaningful only as a smoke run).
- Copy bandwidth: a device-to-device copy of one buffer into another, bytes read plus bytes written over
  the time (the usual ceiling for memory-bound kernels).
- Decode attention bandwidth: the bytes the decode kernel must move, each once: the K and V of every
  cached token of every request (exactly seq_len tokens, not whole blocks), plus the queries read and
  the outputs written. Block tables, lengths and the split scratch (partial outputs and log-sum-exps,
  reported apart) are not counted.
- Correctness: each kernel against attention.py's torch reference computed in fp32 on the same rounded
  inputs, on the same device; pass when every element is within atol + rtol x |reference| and the
  output is finite.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from flotilla.bench.engine.gpu_figures import AttentionShape, KernelShape
from flotilla.engine.kernels import attention

# (atol, rtol) against the fp32 reference: a few units in the last place of the output dtype.
TOLERANCES = {"float16": (5e-3, 5e-3), "bfloat16": (2e-2, 2e-2), "float32": (1e-5, 1e-5)}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def triton_skip_reason(device_type: str, environ: dict[str, str] | None = None) -> str | None:
    """Why the Triton kernels cannot run here, or None when they can (on CUDA, or on the CPU under
    Triton's interpreter)."""
    env = os.environ if environ is None else environ
    if device_type == "cuda":
        return None
    if device_type == "cpu" and env.get("TRITON_INTERPRET") == "1":
        return None
    return (
        f"the Triton kernels need CUDA; on {device_type} they run only in Triton's interpreter "
        "(set TRITON_INTERPRET=1 before starting)"
    )


def dtype_skip_reason(dtype: str, device_type: str) -> str | None:
    """bfloat16 cannot be checked in the interpreter: Triton's CPU interpreter runs tl.dot on bfloat16's raw
    bits (seen with Triton 3.9), so its answers are wrong for reasons the GPU does not share."""
    if dtype == "bfloat16" and device_type != "cuda":
        return "Triton's interpreter computes tl.dot on bfloat16's raw bits; checked on CUDA only"
    return None


# -- timing --------------------------------------------------------------------------------------------
def sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_per_call_ms(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int, inner: int = 1
) -> list[float]:
    """Milliseconds per call of fn, one figure per sample of `inner` back-to-back calls."""
    sync = sync_for(device)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return samples


def graph_time_per_call_ms(fn: Callable[[], object], repeats: int, inner: int) -> list[float]:
    """On CUDA: `inner` calls captured in one CUDA graph, each replay timed with events, so no launch gap
    counts (a small kernel can finish before Python launches the next). fn must have been called before
    (compiled) and must not synchronize."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch's capture recipe says
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    del graph
    return samples


def gb_per_s(nbytes: float, ms: float) -> float:
    """Bytes moved in `ms` milliseconds, in GB/s (10^9 bytes)."""
    return nbytes / (ms * 1e-3) / 1e9


def measure_copy_bandwidth(
    device: torch.device, nbytes: int, warmup: int, repeats: int, inner: int = 1
) -> dict[str, Any]:
    """A device-to-device copy of nbytes: bytes read plus bytes written (2 x nbytes) over the median time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(7)
    dst = torch.empty_like(src)
    times = time_per_call_ms(lambda: dst.copy_(src), device, warmup, repeats, inner)
    ms = statistics.median(times)
    return {
        "buffer_bytes": nbytes,
        "bytes_moved_per_copy": 2 * nbytes,
        "ms_median": ms,
        "ms_samples": times,
        "gb_per_s": gb_per_s(2 * nbytes, ms),
    }


# -- inputs --------------------------------------------------------------------------------------------
def random_paged(
    seq_lens: Sequence[int], shape: KernelShape, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V caches [blocks, block_size, KVH, D] holding each sequence in shuffled blocks (three spare),
    and the block tables [len(seq_lens), max blocks] int32, padded with 0."""
    bs = shape.block_size
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    cpu_gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=cpu_gen).tolist()
    width = max(blocks_per_seq)
    tables = []
    for nb in blocks_per_seq:
        ids = [order.pop() for _ in range(nb)]
        tables.append(ids + [0] * (width - nb))
    gen = torch.Generator(device=device).manual_seed(seed)
    dims = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(dims, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(dims, generator=gen, device=device).to(dtype)
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=device)


@contextlib.contextmanager
def exact_reference(device: torch.device) -> Iterator[None]:
    """The reference in plain fp32 arithmetic: on CUDA, SDPA's math backend (its fused kernels need not be
    exact in fp32; plain matmuls stay fp32 while torch's TF32 switch is off, its default)."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> dict[str, Any]:
    atol, rtol = TOLERANCES[dtype]
    out32 = out.float()
    err = (out32 - ref).abs()
    finite = bool(torch.isfinite(out32).all())
    within = bool((err <= atol + rtol * ref.abs()).all())
    return {
        "max_abs_err": float(err.max()) if err.numel() else 0.0,
        "atol": atol,
        "rtol": rtol,
        "passed": finite and within,
    }


# -- correctness ---------------------------------------------------------------------------------------
def check_decode(
    shape: KernelShape, seq_lens: Sequence[int], dtype: str, device: torch.device, seed: int = 0
) -> dict[str, Any]:
    from flotilla.engine.kernels import triton_attention as tk

    k_cache, v_cache, tables = random_paged(seq_lens, shape, DTYPES[dtype], device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), shape.num_heads, shape.head_dim, generator=gen, device=device)
    q = q.to(DTYPES[dtype])
    scale = shape.head_dim**-0.5
    lens = torch.tensor(list(seq_lens), dtype=torch.int32, device=device)
    out = tk.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, max_seq_len=max(seq_lens))
    with exact_reference(device):
        ref = attention.paged_decode_attention(
            q.float(), k_cache.float(), v_cache.float(), tables, list(seq_lens), scale
        )
    return {
        "kernel": "decode",
        **_shape_fields(shape),
        "dtype": dtype,
        "seq_lens": list(seq_lens),
        "splits": tk.decode_splits(max(seq_lens), shape.block_size),
        **compare(out, ref, dtype),
    }


def check_prefill(
    shape: KernelShape, chunks: Sequence[tuple[int, int]], dtype: str, device: torch.device, seed: int = 0
) -> dict[str, Any]:
    """chunks: (cached context, new tokens) per request, all in one varlen launch."""
    from flotilla.engine.kernels import triton_attention as tk

    seq_lens = [c + n for c, n in chunks]
    k_cache, v_cache, tables = random_paged(seq_lens, shape, DTYPES[dtype], device, seed)
    num_tokens = sum(n for _, n in chunks)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    q = torch.randn(num_tokens, shape.num_heads, shape.head_dim, generator=gen, device=device)
    q = q.to(DTYPES[dtype])
    scale = shape.head_dim**-0.5
    query_start = [0]
    for _, n in chunks:
        query_start.append(query_start[-1] + n)
    contexts = [c for c, _ in chunks]
    tiles = tk.prefill_tiles(
        query_start, contexts, range(len(chunks)), tk.prefill_block_m(shape.group), device
    )
    out = tk.paged_prefill_attention(q, k_cache, v_cache, tables, tiles, scale)
    k32, v32, q32 = k_cache.float(), v_cache.float(), q.float()
    with exact_reference(device):
        ref = torch.cat([
            attention.paged_prefill_attention(q32[query_start[r] : query_start[r + 1]], k32, v32, tables[r], c, scale)
            for r, c in enumerate(contexts)
        ])  # fmt: skip
    return {
        "kernel": "prefill",
        **_shape_fields(shape),
        "dtype": dtype,
        "chunks": [list(c) for c in chunks],
        **compare(out, ref, dtype),
    }


def check_store(shape: KernelShape, num_tokens: int, dtype: str, device: torch.device, seed: int = 0) -> dict:
    """The KV store against index_copy_: exact."""
    from flotilla.engine.kernels import triton_attention as tk

    gen = torch.Generator(device=device).manual_seed(seed)
    num_blocks = -(-num_tokens // shape.block_size) + 2
    dims = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, generator=gen, device=device)
    value = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, generator=gen, device=device)
    key, value = key.to(DTYPES[dtype]), value.to(DTYPES[dtype])
    cpu_gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * shape.block_size, generator=cpu_gen)[:num_tokens].to(device)
    ref_k, ref_v = (torch.zeros(dims, dtype=DTYPES[dtype], device=device) for _ in range(2))
    out_k, out_v = (torch.zeros(dims, dtype=DTYPES[dtype], device=device) for _ in range(2))
    attention.store_kv(key, value, ref_k, ref_v, slots)
    tk.store_kv(key, value, out_k, out_v, slots)
    exact = bool(torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v))
    return {
        "kernel": "store_kv",
        **_shape_fields(shape),
        "dtype": dtype,
        "tokens": num_tokens,
        "max_abs_err": float(max((out_k - ref_k).abs().max(), (out_v - ref_v).abs().max())),
        "atol": 0.0,
        "rtol": 0.0,
        "passed": exact,
    }


def _shape_fields(shape: KernelShape) -> dict[str, int]:
    return {
        "block_size": shape.block_size,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "gqa_group": shape.group,
        "head_dim": shape.head_dim,
    }


# -- decode bandwidth ----------------------------------------------------------------------------------
def decode_bytes(
    batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int, elsize: int
) -> int:
    """The bytes a decode step of attention must move: K and V of every cached token, read once, plus
    the queries read and the outputs written."""
    kv = 2 * batch * context * num_kv_heads * head_dim * elsize
    q_out = 2 * batch * num_heads * head_dim * elsize
    return kv + q_out


def measure_decode_bandwidth(
    case: AttentionShape, device: torch.device, warmup: int, repeats: int, inner: int, seed: int = 0
) -> dict[str, Any]:
    from flotilla.engine.kernels import triton_attention as tk

    dtype = DTYPES[case.dtype]
    shape = KernelShape(case.block_size, case.num_heads, case.num_kv_heads, case.head_dim)
    seq_lens = [case.context] * case.batch
    k_cache, v_cache, tables = random_paged(seq_lens, shape, dtype, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    q = torch.randn(case.batch, case.num_heads, case.head_dim, generator=gen, device=device).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = case.head_dim**-0.5

    def call():
        return tk.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, max_seq_len=case.context)

    times = time_per_call_ms(call, device, warmup, repeats, inner)
    ms = eager_ms = statistics.median(times)
    timing, graph_ms, graph_error = "eager", None, None
    if device.type == "cuda":
        try:
            graph_ms = statistics.median(graph_time_per_call_ms(call, repeats, inner))
            ms, timing = graph_ms, "cuda_graph"
        except Exception as exc:  # the eager figure stands; say why the graph did not
            graph_error = f"{type(exc).__name__}: {exc}"[:500]
    elsize = torch.finfo(dtype).bits // 8
    nbytes = decode_bytes(case.batch, case.context, case.num_heads, case.num_kv_heads, case.head_dim, elsize)
    splits = tk.decode_splits(case.context, case.block_size)
    scratch = 0 if splits == 1 else 2 * case.batch * case.num_heads * splits * (case.head_dim + 1) * 4
    return {
        "name": case.name,
        "batch": case.batch,
        "context": case.context,
        "num_heads": case.num_heads,
        "num_kv_heads": case.num_kv_heads,
        "head_dim": case.head_dim,
        "block_size": case.block_size,
        "dtype": case.dtype,
        "splits": splits,
        "bytes_counted": nbytes,
        "split_scratch_bytes": scratch,
        "timing": timing,  # cuda_graph: replays of captured calls; eager: back-to-back launches
        "ms_median": ms,
        "ms_median_eager": eager_ms,
        "ms_samples_eager": times,
        "ms_median_graph": graph_ms,
        "graph_error": graph_error,
        "gb_per_s": gb_per_s(nbytes, ms),
        "gb_per_s_eager": gb_per_s(nbytes, eager_ms),
    }
