"""`flotilla images build`: the pure parts without buildah (the base recipe's digest, the buildah command
for a target, the bases a target needs, the step clock, the missing-tools error), and, marked `images`,
the real build of the operator and gateway images, whose commands are then run inside them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from flotilla import contract
from flotilla.cli import main
from flotilla.images import tools
from flotilla.images.base import mirror_from_sources
from flotilla.images.build import IMAGES, StepClock, base_images, bud_argv
from flotilla.images.recipe import BASES, FULL, SLIM, BaseRecipe, canonical_image

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


# -- the base recipe -----------------------------------------------------------------------------------
def test_the_digest_changes_when_the_package_list_changes_and_not_otherwise() -> None:
    same = BaseRecipe(SLIM.image, tuple(SLIM.packages))
    assert same.digest() == SLIM.digest()  # deterministic: equal recipes, equal digests
    assert dataclasses.replace(SLIM, packages=(*SLIM.packages, "curl")).digest() != SLIM.digest()
    assert dataclasses.replace(SLIM, packages=SLIM.packages[:-1]).digest() != SLIM.digest()
    assert dataclasses.replace(SLIM, suite="trixie").digest() != SLIM.digest()
    assert dataclasses.replace(SLIM, setup=SLIM.setup + "true\n").digest() != SLIM.digest()
    assert FULL.digest() != SLIM.digest()


def test_the_digest_covers_the_machines_certificates_but_not_their_order() -> None:
    assert SLIM.digest([b"a", b"b"]) == SLIM.digest([b"b", b"a"])
    assert SLIM.digest([b"a"]) != SLIM.digest([b"b"]) != SLIM.digest()


def test_the_chroot_script_installs_the_packages_and_stops_at_the_first_failure() -> None:
    script = FULL.script()
    assert script.startswith("set -eu\n")
    assert f"apt-get install -y -q --no-install-recommends {' '.join(FULL.packages)}\n" in script
    # Triton compiles with gcc at run time: the engine's base has a C toolchain, the slim one does not.
    assert {"gcc", "libc6-dev", "python3-dev"} <= set(FULL.packages) - set(SLIM.packages)
    assert "mkdir -p /usr/local/lib/python3.11" in script  # the Dockerfile byte-compiles it


def test_image_names_are_canonical() -> None:
    assert canonical_image("python:3.11-slim-bookworm") == "docker.io/library/python:3.11-slim-bookworm"
    assert canonical_image("envoyproxy/envoy:v1") == "docker.io/envoyproxy/envoy:v1"
    assert canonical_image(contract.OPERATOR_IMAGE) == contract.OPERATOR_IMAGE


# -- the Dockerfile's targets ------------------------------------------------------------------------------
def test_each_target_is_built_with_runc_no_pull_and_the_contracts_name() -> None:
    assert bud_argv("operator", ROOT, DOCKERFILE) == [
        "buildah",
        "bud",
        "--runtime=/usr/sbin/runc",
        "--pull=never",
        "--network=host",
        "--target",
        "operator",
        "-t",
        contract.OPERATOR_IMAGE,
        "-f",
        str(DOCKERFILE),
        str(ROOT),
    ]
    assert IMAGES == {
        "engine": contract.ENGINE_IMAGE,
        "operator": contract.OPERATOR_IMAGE,
        "gateway": contract.GATEWAY_IMAGE,
    }


def test_the_bases_a_target_needs_come_from_the_dockerfile_and_each_has_a_recipe() -> None:
    text = DOCKERFILE.read_text()
    assert base_images(text, ["operator", "gateway"]) == [SLIM.image]
    # The engine's own stage is on the full image; its wheels come from the slim builder stage.
    assert sorted(base_images(text, ["engine"])) == sorted([SLIM.image, FULL.image])
    assert set(base_images(text, list(IMAGES))) <= set(BASES)


def test_a_stage_copied_from_counts_and_one_not_needed_does_not() -> None:
    text = (
        "FROM alpine:3 AS tools\nFROM busybox AS unused\nFROM debian:12 AS app\nCOPY --from=tools /bin/x /x\n"
    )
    assert base_images(text, ["app"]) == ["docker.io/library/alpine:3", "docker.io/library/debian:12"]


def test_the_step_clock_says_how_long_each_step_took() -> None:
    lines, now = [], iter([0.0, 2.5, 10.0, 10.5])
    clock = StepClock(lines.append, "[operator]", clock=lambda: next(now))
    for line in (
        "[1/3] STEP 1/9: FROM python:3.11-slim-bookworm AS wheels",
        "Collecting setuptools>=77",
        '[3/3] STEP 8/8: CMD ["operator", "run"]',
        "[3/3] COMMIT ghcr.io/flotilla-dev/flotilla-operator:0.1.0",
    ):
        clock.line(line)
    clock.finish()
    assert lines == [
        "[operator] -- [1/3] STEP 1/9 took 2.5s",
        "[operator] -- [3/3] STEP 8/8 took 7.5s",
        "[operator] -- [3/3] COMMIT took 0.5s",
    ]


# -- the machine ---------------------------------------------------------------------------------------
def test_a_missing_tool_is_named_by_its_debian_package() -> None:
    assert tools.missing_packages(lambda tool: False) == ["buildah", "runc", "debootstrap"]
    assert tools.missing_packages(lambda tool: tool != "debootstrap") == ["debootstrap"]
    with pytest.raises(tools.ImagesError, match=r"apt-get install -y buildah runc debootstrap"):
        tools.check_host(lambda tool: False, euid=0)
    with pytest.raises(tools.ImagesError, match="root"):
        tools.check_host(lambda tool: True, euid=1000)


def test_the_command_installs_nothing_and_names_the_missing_packages(monkeypatch, capsys) -> None:
    monkeypatch.setattr(
        tools, "TOOLS", {"/nonexistent/flotilla-runc": "runc", "no-such-flotilla-tool": "buildah"}
    )
    assert main(["images", "build", "--context", str(ROOT)]) == 1
    assert "apt-get install -y runc buildah" in capsys.readouterr().err


def test_the_mirror_is_the_one_apt_uses_for_the_suite_itself() -> None:
    deb822 = (
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n"
    )
    assert mirror_from_sources({"debian.sources": deb822}) == "http://mirror.example/debian"
    one_line = "deb http://security.example/ bookworm-security main\ndeb [arch=amd64] http://m.example/debian bookworm main\n"
    assert mirror_from_sources({"sources.list": one_line}) == "http://m.example/debian"
    assert mirror_from_sources({"other.list": "deb http://x.example/ trixie main\n"}) is None


# -- the real build (root, buildah, runc and debootstrap; minutes, downloads from Debian and PyPI) --------------
LIGHT = ("operator", "gateway")
WALK = (
    "import importlib, pkgutil, sys\n"
    "import {package} as root\n"
    "names = [m.name for m in pkgutil.walk_packages(root.__path__, root.__name__ + '.')]\n"
    "[importlib.import_module(name) for name in names]\n"
    "heavy = sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules)\n"
    "assert not heavy, heavy\n"
    "print(len(names))\n"
)
MISSING = tools.missing_packages()


def _run_in(image: str, argv: list[str]) -> subprocess.CompletedProcess:
    """Run argv in a container of the image, as the image's user, without a network."""
    container = subprocess.run(
        ["buildah", "from", "--pull=never", image], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        return subprocess.run(
            ["buildah", "run", f"--runtime={tools.RUNC}", "--network=none", container, "--", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)


@pytest.mark.images
@pytest.mark.timeout(1800)
@pytest.mark.skipif(
    bool(MISSING),
    reason=f"needs the Debian packages {', '.join(MISSING)} (apt-get install -y {' '.join(MISSING)})",
)
def test_the_light_images_build_and_their_commands_run_inside(built_images: str) -> None:
    for target in LIGHT:
        image = IMAGES[target]
        assert image in built_images  # the summary: name, id, size
        config = json.loads(
            subprocess.run(
                ["buildah", "inspect", "--type", "image", image], capture_output=True, text=True, check=True
            ).stdout
        )["OCIv1"]["config"]
        assert config["User"] == f"{contract.IMAGE_UID}:{contract.IMAGE_UID}"
        entrypoint = config["Entrypoint"]
        for args in (["--help"], [target, "run", "--help"]):
            ran = _run_in(image, [*entrypoint, *args])
            assert ran.returncode == 0, f"{image} {args}: {ran.stdout}{ran.stderr}"
            assert "usage: flotilla" in ran.stdout
        uid = _run_in(image, ["id", "-u"])
        assert uid.stdout.strip() == str(contract.IMAGE_UID), uid.stderr
        # Every module of the image's distribution imports with what the image installed (a dependency
        # the distribution forgot to declare fails here), and none pulls in torch.
        imported = _run_in(image, ["python", "-c", WALK.format(package=f"flotilla.{target}")])
        assert imported.returncode == 0, imported.stderr
        assert int(imported.stdout.strip()) > 5, imported.stdout
        # A group whose distribution the image lacks says so (issue 43: it crashed every image at start).
        for group in ("engine", "model", *(t for t in LIGHT if t != target)):
            absent = _run_in(image, [*entrypoint, group, "run"])
            assert absent.returncode == 2, (image, group, absent.stdout, absent.stderr)
            assert (
                f"flotilla {group}: not installed here" in absent.stderr and "Traceback" not in absent.stderr
            )
