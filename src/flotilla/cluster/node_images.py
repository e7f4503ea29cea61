"""Images for the kubelet nodes without a registry: the pods' sandbox (pause) made from the Kubernetes
module's own pause.c, written as an archive every node imports when it starts, and any image in buildah's
storage streamed into a running node's containerd (`flotilla cluster load-image`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

from flotilla.cluster.gomod import go_env
from flotilla.cluster.node_host import ARCHIVE_SUFFIX, ctr, images_dir, in_node
from flotilla.cluster.node_layout import PAUSE_IMAGE, NodeLayout
from flotilla.cluster.paths import cache_root
from flotilla.cluster.processes import ProcessTable
from flotilla.cluster.versions import KUBERNETES_VERSION


class ImageError(RuntimeError):
    pass


def _run(argv: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise ImageError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


def archive_path(cluster_state: Path, image: str) -> Path:
    return images_dir(cluster_state) / (re.sub(r"[^A-Za-z0-9_.-]+", "_", image) + ARCHIVE_SUFFIX)


def pause_binary() -> Path:
    """pause.c of the pinned Kubernetes release, compiled static as upstream does (cached)."""
    out = cache_root() / f"pause-{KUBERNETES_VERSION}" / "pause"
    if out.exists():
        return out
    info = json.loads(
        _run(["go", "mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"], go_env())
    )
    source = Path(info["Dir"]) / "build" / "pause" / "linux" / "pause.c"
    if shutil.which("gcc") is None:
        raise ImageError("gcc is needed to compile the pods' pause binary (apt-get install -y gcc libc6-dev)")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    _run(
        [
            "gcc",
            "-Os",
            "-Wall",
            "-Werror",
            "-static",
            f"-DVERSION={KUBERNETES_VERSION}",
            "-o",
            str(partial),
            str(source),
        ]
    )
    partial.replace(out)
    return out


def _image_exists(image: str) -> bool:
    return (
        subprocess.run(["buildah", "inspect", "--type", "image", image], capture_output=True).returncode == 0
    )


def ensure_pause_image() -> None:
    if _image_exists(PAUSE_IMAGE):
        return
    binary = pause_binary()
    container = _run(["buildah", "from", "scratch"]).strip()
    try:
        _run(["buildah", "copy", "--chmod", "0755", container, str(binary), "/pause"])
        _run(["buildah", "config", "--entrypoint", '["/pause"]', "--user", "65535:65535", container])
        _run(["buildah", "commit", "--quiet", container, PAUSE_IMAGE])
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)


def image_id(image: str) -> str:
    return _run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", image]).strip()


def export_image(cluster_state: Path, image: str) -> Path:
    """image (in buildah's storage) as a docker archive the nodes import; rewritten only when its id changed."""
    if not _image_exists(image):
        raise ImageError(f"image {image} is not in buildah's storage: run `flotilla images build` first")
    archive = archive_path(cluster_state, image)
    stamp = archive.with_suffix(".id")
    current = image_id(image)
    if archive.exists() and stamp.exists() and stamp.read_text() == current:
        return archive
    archive.parent.mkdir(parents=True, exist_ok=True)
    archive.unlink(missing_ok=True)
    _run(["buildah", "push", "--quiet", image, f"docker-archive:{archive}:{image}"])
    stamp.write_text(current)
    return archive


def load_image(table: ProcessTable, layout: NodeLayout, image: str) -> float:
    """Streams image from buildah's storage into a running node's containerd (a docker archive through a
    pipe: nothing written to disk twice), where the kubelet finds it; the seconds it took."""
    if not _image_exists(image):
        raise ImageError(f"image {image} is not in buildah's storage: run `flotilla images build` first")
    started = time.monotonic()
    push = subprocess.Popen(
        ["buildah", "push", "--quiet", image, f"docker-archive:/dev/stdout:{image}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert push.stdout is not None
    imported = subprocess.run(
        in_node(table, layout, *ctr(layout), "images", "import", "-"),
        stdin=push.stdout,
        capture_output=True,
        text=True,
    )
    push.stdout.close()
    pushed_error = push.stderr.read().decode(errors="replace") if push.stderr else ""
    if push.wait() != 0 or imported.returncode != 0:
        raise ImageError(
            f"loading {image} into {layout.name} failed: buildah push said {pushed_error.strip()!r}, "
            f"ctr import said {imported.stderr.strip()!r}"
        )
    return time.monotonic() - started
