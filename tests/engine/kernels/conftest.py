"""The C library built twice: natively (16-float vectors where the machine has AVX-512) and without
AVX-512 (the 8-float paths every x86 machine with AVX2 takes), so that a machine with the wide paths checks
both."""

from __future__ import annotations

import platform

import pytest

from flotilla.engine.kernels import c_library

NARROW_FLAGS = ("-mno-avx512f",)


@pytest.fixture(params=["native", "narrow"])
def c_build(request):
    """None for the native build, else the library built with NARROW_FLAGS (x86 only: the flag is x86's)."""
    if request.param == "narrow" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the build without AVX-512 is an x86 build")
    return c_library.load(NARROW_FLAGS) if request.param == "narrow" else None
