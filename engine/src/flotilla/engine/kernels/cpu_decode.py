"""The CPU's paged decode kernel (paged_decode.c, float32 and bfloat16 caches): built on first use with the system C compiler, loaded
with ctypes, called on torch tensors' memory.

The build is a plain shared library (no torch headers: about 3 s, once per machine), tuned for the machine it runs on
(-march=native), cached under $XDG_CACHE_HOME/flotilla/kernels by a hash of the source, the flags and the
CPU's features. The engine image has gcc (Triton needs it too); where no compiler works, `load()` says why
and the torch path serves instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from flotilla.engine.kernels.attention import TorchAttentionBackend

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
# -ffp-contract=fast: ISO C mode (-std=c11) would otherwise keep every a += b * c a multiply and an add
# instead of one FMA (faster, and rounded once).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# The kernel's entry point per cache dtype: queries and outputs are float32 in both.
SYMBOLS = {torch.float32: "flotilla_paged_decode_f32", torch.bfloat16: "flotilla_paged_decode_bf16"}
# paged_decode.c's MAX_HEAD_DIM, MAX_GROUP and MAX_BLOCK.
MAX_HEAD_DIM, MAX_GROUP, MAX_BLOCK = 256, 16, 64


class KernelUnavailable(RuntimeError):
    pass


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "flotilla" / "kernels"


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    raise KernelUnavailable("no C compiler (cc, gcc or clang) on PATH")


def _build(compiler: str, target: Path) -> None:
    """Compiles into a temporary file beside the target, then renames it: processes building at once
    each write their own file and the last rename wins with an identical library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        log.info("compiling the CPU paged-attention kernel (%s) ...", SOURCE.name)
        done = subprocess.run(
            [compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed on {SOURCE.name}: {done.stderr.strip()[:2000]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu_features() -> str:
    """The CPU's feature flags: -march=native builds for them, so a cache shared between machines (a
    network home) keeps one library per kind of CPU instead of one that faults on an older CPU."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


@cache
def load() -> ctypes.CDLL:
    """The built library (built now if not cached). Raises KernelUnavailable with the reason."""
    compiler = _compiler()
    identity = "\0".join((compiler, *FLAGS, _cpu_features())).encode()
    key = hashlib.sha256(SOURCE.read_bytes() + identity).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{key}.so"
    if not target.exists():
        try:
            _build(compiler, target)
        except OSError as exc:  # an unwritable cache: build in a private temporary folder instead
            target = Path(tempfile.mkdtemp(prefix="flotilla-kernels-")) / target.name
            log.info("kernel cache %s unusable (%s); building in %s", _cache_dir(), exc, target.parent)
            _build(compiler, target)
    lib = ctypes.CDLL(str(target))
    i32, i64 = ctypes.c_int32, ctypes.c_int64
    ptr = ctypes.c_void_p
    for symbol in SYMBOLS.values():
        fn = getattr(lib, symbol)
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i32, i32, i32, i32, i32, ctypes.c_float, i32]
        fn.restype = ctypes.c_int32
    return lib


def shape_limits(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int) -> str | None:
    """None when the kernel handles these sizes (its stack arrays are fixed); otherwise which one not."""
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim}: it handles multiples of 8 up to {MAX_HEAD_DIM}"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads} heads over {num_kv_heads} KV heads: it handles up to {MAX_GROUP} per KV head"
    if block_size > MAX_BLOCK:
        return f"block_size {block_size}: it handles up to {MAX_BLOCK}"
    return None


def unusable(device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int,
             block_size: int) -> str | None:  # fmt: skip
    """None when the kernel serves this device, KV dtype and model; otherwise why not."""
    if device.type != "cpu":
        return f"it runs on the CPU, the device is {device.type}"
    if dtype not in SYMBOLS:
        return f"it reads float32 and bfloat16 caches, the dtype is {str(dtype).removeprefix('torch.')}"
    if reason := shape_limits(head_dim, num_heads, num_kv_heads, block_size):
        return reason
    try:
        load()
    except KernelUnavailable as exc:
        return str(exc)
    return None


def paged_decode(
    query: torch.Tensor,  # [B, H, D], the caches' dtype (or float32)
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] float32 or bfloat16, contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, >= ceil(max seq_len / block_size)] int32, rows contiguous
    seq_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
) -> torch.Tensor:
    dtype = query.dtype
    query = query.to(
        torch.float32
    ).contiguous()  # a copy of a few KiB for bfloat16: the kernel adds in float32
    batch, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and cache_dim == head_dim):
        raise ValueError(
            f"caches must be contiguous [blocks, block_size, KVH, {head_dim}], got {k_cache.shape}"
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables and seq_lens must be int32, block_tables' rows contiguous")
    if reason := shape_limits(head_dim, num_heads, num_kv_heads, block_size):
        raise ValueError(reason)
    if k_cache.dtype not in SYMBOLS or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches must be float32 or bfloat16, got {k_cache.dtype} and {v_cache.dtype}")
    out = torch.empty_like(query)
    if batch == 0:
        return out.to(dtype)
    getattr(load(), SYMBOLS[k_cache.dtype])(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
        batch, num_heads, num_kv_heads, head_dim, block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    return out.to(dtype)


@dataclass
class CpuDecodePlan:
    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with decode through the compiled kernel (float32 and bfloat16 caches; prefill chunks, and
    speculative verification's several tokens per request, keep the torch path)."""

    name = "cpu"

    def plan_decode(self, block_tables: torch.Tensor, seq_lens: list[int], block_size: int) -> object:
        return CpuDecodePlan(
            block_tables.to(torch.int32).contiguous(), torch.tensor(seq_lens, dtype=torch.int32)
        )

    def decode(self, query, k_cache, v_cache, plan, scale: float) -> torch.Tensor:
        assert isinstance(plan, CpuDecodePlan)
        return paged_decode(query, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale)
