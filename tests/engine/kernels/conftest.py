"""The C library built natively (16-float vectors where the machine has AVX-512) and without AVX-512 (the
8-float paths every x86 machine with AVX2 takes), so that a machine with the wide paths checks both; for
paged_prefill.c, whose bfloat16 scores have a path of their own for AVX512-BF16, and cpu_ops.c, which rounds
to bfloat16 with the CPU's own instruction there, also wide without it."""

from __future__ import annotations

import platform

import pytest

from flotilla.engine.kernels import c_library

NARROW_FLAGS = ("-mno-avx512f",)
WIDE_WITHOUT_BF16_FLAGS = ("-mno-avx512bf16",)


def _build(name: str):
    """None for the native build, else the library built with the variant's flags (x86 only)."""
    if name == "native":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the {name} build is an x86 build")
    if name == "wide-without-bf16":
        if "avx512_bf16" not in c_library._cpu_features().split():
            pytest.skip("the native build is already one without AVX512-BF16")
        return c_library.load(WIDE_WITHOUT_BF16_FLAGS)
    return c_library.load(NARROW_FLAGS)


@pytest.fixture(params=["native", "narrow"])
def c_build(request):
    return _build(request.param)


@pytest.fixture(params=["native", "narrow", "wide-without-bf16"])
def c_build_bf16_paths(request):
    """c_build, and the wide build without AVX512-BF16: for the kernels with a path of their own for it."""
    return _build(request.param)
