"""The CPU's C kernels as one shared library (paged_decode.c: decode attention; cpu_ops.c: fused
elementwise ops; vectors.h: what they share), built on first use with the system C compiler, loaded with
ctypes, called on torch tensors' memory.

The build is a plain shared library (no torch headers: about 3 s, once per machine), tuned for the machine
it runs on (-march=native), cached under $XDG_CACHE_HOME/flotilla/kernels by a hash of the sources, the
flags and the CPU's features. The engine image has gcc (Triton needs it too); where no compiler works,
`load()` says why and the torch paths serve instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "paged_decode.c", HERE / "paged_prefill.c", HERE / "cpu_ops.c")
HEADERS = (HERE / "vectors.h",)
# -ffp-contract=fast: ISO C mode (-std=c11) would otherwise keep every a += b * c a multiply and an add
# instead of one FMA (faster, and rounded once).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")


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


def _build(compiler: str, target: Path, flags: tuple[str, ...] = FLAGS) -> None:
    """Compiles into a temporary file beside the target, then renames it: processes building at once
    each write their own file and the last rename wins with an identical library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    names = ", ".join(source.name for source in SOURCES)
    try:
        log.info("compiling the CPU kernels (%s) ...", names)
        done = subprocess.run(
            [compiler, *flags, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed on {names}: {done.stderr.strip()[:2000]}")
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
def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The built library (built now if not cached). Raises KernelUnavailable with the reason.
    `extra_flags` build a variant (the tests use `-mno-avx512f` to run the kernels' narrower paths on a
    machine whose native build takes the AVX-512 ones)."""
    compiler = _compiler()
    flags = (*FLAGS, *extra_flags)
    identity = "\0".join((compiler, *flags, _cpu_features())).encode()
    code = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(code + identity).hexdigest()[:16]
    target = _cache_dir() / f"flotilla_cpu-{key}.so"
    if not target.exists():
        try:
            _build(compiler, target, flags)
        except OSError as exc:  # an unwritable cache: build in a private temporary folder instead
            target = Path(tempfile.mkdtemp(prefix="flotilla-kernels-")) / target.name
            log.info("kernel cache %s unusable (%s); building in %s", _cache_dir(), exc, target.parent)
            _build(compiler, target, flags)
    return ctypes.CDLL(str(target))


def function(name: str, argtypes: list, restype=None):
    """One of the library's functions, typed. Raises KernelUnavailable (no compiler, a failed build)."""
    fn = getattr(load(), name)
    fn.argtypes = argtypes
    fn.restype = restype
    return fn
