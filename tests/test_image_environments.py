"""Each light image's Python environment built as its Dockerfile stage builds it, and started: the wheels of
its own distributions only (the builder's `pip wheel --no-deps`), installed into a fresh virtualenv with
their declared dependencies from the index, and nothing else of the development environment. Then the
image's entry point runs its CMD's `--help`, every module of its distribution imports, and a command group
whose distribution the image lacks says so instead of crashing (issue 43: `flotilla operator run` in the
operator image ended with `ModuleNotFoundError: No module named 'flotilla.engine'`).

The engine image is not built here: its torch and CUDA wheels are gigabytes, and the development
environment's own engine tests run the same distribution."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .test_images import DISTRIBUTIONS, ROOT, STAGES, installed

LIGHT_TARGETS = ("gateway", "operator")
# A command group of each distribution that an image may lack, and the module whose absence shows.
GROUPS = {"flotilla_engine": "engine", "flotilla_operator": "operator", "flotilla_gateway": "gateway"}
PIP_TIMEOUT = 900  # seconds: a fresh machine downloads the dependencies from the index


def _run(argv: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    # Nothing of the development environment leaks in: no PYTHONPATH, no activated venv.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)


# What the builder stage copies of the root distribution (the other distributions are whole folders).
ROOT_FILES = ("pyproject.toml", "README.md", "src")
LEFT_OUT = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """The builder stage's wheels of the distributions the light images install, built from a copy of
    what it copies (setuptools writes build/ beside the sources: not into the checkout)."""
    out, context = tmp_path_factory.mktemp("wheels"), tmp_path_factory.mktemp("context")
    needed = set().union(*(installed(t) for t in LIGHT_TARGETS))
    folders = []
    for name in sorted(needed):
        source = DISTRIBUTIONS[name][0]
        if source == ROOT:
            for item in ROOT_FILES:
                if (ROOT / item).is_dir():
                    shutil.copytree(ROOT / item, context / item, ignore=LEFT_OUT)
                else:
                    shutil.copy2(ROOT / item, context / item)
            folders.append(str(context))
        else:
            shutil.copytree(source, context / source.name, ignore=LEFT_OUT)
            folders.append(str(context / source.name))
    print(f"building wheels of {sorted(needed)}", file=sys.stderr, flush=True)
    done = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                 "--wheel-dir", str(out), *folders], timeout=PIP_TIMEOUT, cwd=context)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module", params=LIGHT_TARGETS)
def image_env(request, wheels, tmp_path_factory) -> tuple[str, Path]:
    """A target's /opt/flotilla: a venv with the target's wheels and their dependencies, nothing more."""
    target = request.param
    venv = tmp_path_factory.mktemp(f"{target}-env") / "opt-flotilla"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    files = sorted(str(next(wheels.glob(f"{name}-*.whl"))) for name in installed(target))
    print(f"{target}: installing {', '.join(Path(f).name for f in files)} with their dependencies",
          file=sys.stderr, flush=True)  # fmt: skip
    done = _run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", *files],
                timeout=PIP_TIMEOUT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return target, venv


def test_the_images_entry_point_runs_its_cmd(image_env) -> None:
    target, venv = image_env
    stage = STAGES[target]
    entrypoint, cmd = stage.exec_form("ENTRYPOINT"), stage.exec_form("CMD")
    done = _run([str(venv / "bin" / entrypoint[0]), *entrypoint[1:], *cmd, "--help"], cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: flotilla " + " ".join(cmd)), done.stdout
    whole = _run([str(venv / "bin" / entrypoint[0]), "--help"], cwd="/")
    assert whole.returncode == 0, whole.stderr


def test_every_module_of_the_images_distributions_imports(image_env) -> None:
    target, venv = image_env
    package = f"flotilla.{target}"
    script = (
        "import importlib, pkgutil, sys\n"
        f"import {package} as root\n"
        "names = [m.name for m in pkgutil.walk_packages(root.__path__, root.__name__ + '.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "print(len(names))\n"
    )
    done = _run([str(venv / "bin" / "python"), "-c", script], cwd="/")
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) > 5  # the walk found the package's modules


def test_a_group_whose_distribution_is_absent_says_so(image_env) -> None:
    target, venv = image_env
    absent = [group for name, group in GROUPS.items() if name not in installed(target)]
    assert absent, f"{target} carries every distribution"
    for group in absent:
        done = _run([str(venv / "bin" / "flotilla"), group], cwd="/")
        assert done.returncode == 2, (group, done.stdout, done.stderr)
        assert f"flotilla {group}: not installed here" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
