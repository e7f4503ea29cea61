"""Fixtures both test trees share (tests/ and e2e/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


def _images_build(*targets: str) -> str:
    argv = [sys.executable, "-m", "flotilla.cli", "images", "build", "--context", str(ROOT)]
    for target in targets:
        argv += ["--target", target]
    print(f"building the images: {' '.join(argv[2:])}", flush=True)
    built = subprocess.run(argv, capture_output=True, text=True, timeout=1700)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    return built.stdout


@pytest.fixture(scope="session")
def built_images() -> str:
    """`flotilla images build` (the default targets: operator, gateway, envoy), once per test session; its
    output (the summary names each image with its id and size). Fails the test that asks for it when the
    build fails."""
    return _images_build()


@pytest.fixture(scope="session")
def built_engine_image() -> str:
    """`flotilla images build --target engine` (CUDA torch and triton: about 6 GB, 3-4 minutes here), once
    per test session."""
    return _images_build("engine")
