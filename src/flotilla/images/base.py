"""Make a stand-in base image from Debian's packages (recipe.py): debootstrap, the packages in a chroot,
then the root filesystem committed by buildah under the official image's name, so that the Dockerfile's
FROM finds it with `--pull=never`. Skipped when the image already carries its recipe's digest."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from flotilla.images.recipe import RECIPE_LABEL, SUITE, BaseRecipe
from flotilla.images.tools import ImagesError, Out, capture, stream

APT_SOURCES = Path("/etc/apt")
FALLBACK_MIRROR = "http://deb.debian.org/debian"
CA_DIR = Path("/usr/local/share/ca-certificates")  # where the machine's own CA certificates are added
WORK_DIR = Path("/var/tmp")  # the root filesystem is made here, on disk (not a tmpfs /tmp)


def mirror_from_sources(sources: dict[str, str], suite: str = SUITE) -> str | None:
    """The first mirror apt's sources (file name -> text) list for `suite` itself (not -updates or
    -security), in one-line (.list) or deb822 (.sources) format."""
    for name, text in sources.items():
        if name.endswith(".sources"):
            for stanza in text.split("\n\n"):
                fields = {}
                for line in stanza.splitlines():
                    key, sep, value = line.partition(":")
                    if sep and not line.startswith(("#", " ")):
                        fields[key.strip().lower()] = value.split()
                if "deb" in fields.get("types", []) and suite in fields.get("suites", []):
                    return fields.get("uris", [None])[0]
        else:
            for line in text.splitlines():
                words = [w for w in line.split("#", 1)[0].split() if not w.startswith("[")]
                if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
                    return words[1]
    return None


def apt_mirror(root: Path = APT_SOURCES) -> str:
    paths = [root / "sources.list", *sorted((root / "sources.list.d").glob("*"))]
    sources = {p.name: p.read_text() for p in paths if p.suffix in (".list", ".sources") and p.is_file()}
    return mirror_from_sources(sources) or FALLBACK_MIRROR


def machine_certificates() -> list[Path]:
    return sorted(CA_DIR.glob("*.crt")) if CA_DIR.is_dir() else []


def image_label(image: str, label: str = RECIPE_LABEL) -> str | None:
    """The value of `label` on a local image; None when there is no such image or label."""
    try:
        info = json.loads(capture(["buildah", "inspect", "--type", "image", image]))
    except ImagesError:
        return None
    return ((info.get("OCIv1") or {}).get("config") or {}).get("Labels", {}).get(label)


def ensure_base(recipe: BaseRecipe, out: Out, mirror: str | None = None) -> float | None:
    """Make the base image unless it is up to date; the seconds it took, None when it was."""
    certificates = machine_certificates()
    digest = recipe.digest(c.read_bytes() for c in certificates)
    if image_label(recipe.image) == digest:
        out(f"[base] {recipe.image}: up to date (recipe {digest[:12]})")
        return None
    started = time.monotonic()
    prefix = f"[base {recipe.image.rsplit('/', 1)[-1]}]"
    rootfs = Path(tempfile.mkdtemp(prefix="flotilla-base-", dir=WORK_DIR))
    try:
        mirror = mirror or apt_mirror()
        out(f"{prefix} debootstrap {recipe.suite} from {mirror}")
        argv = ["debootstrap", f"--variant={recipe.variant}", recipe.suite, str(rootfs), mirror]
        out(f"{prefix} debootstrap took {stream(argv, prefix, out):.0f}s")
        (rootfs / CA_DIR.relative_to("/")).mkdir(parents=True, exist_ok=True)
        for certificate in certificates:
            shutil.copy2(certificate, rootfs / CA_DIR.relative_to("/") / certificate.name)
        seconds = stream(["chroot", str(rootfs), "/bin/sh", "-c", recipe.script()], prefix, out)
        out(f"{prefix} packages and set-up took {seconds:.0f}s")
        _leave_the_host_out(rootfs)
        _commit(rootfs, recipe, digest, prefix, out)
    finally:
        _remove(rootfs)
    seconds = time.monotonic() - started
    out(f"{prefix} {recipe.image} made in {seconds:.0f}s (recipe {digest[:12]})")
    return seconds


def _leave_the_host_out(rootfs: Path) -> None:
    """debootstrap copies the host's resolv.conf and hostname and makes device nodes; a container runtime
    provides its own, so the image carries none (as the official images do not)."""
    _refuse_mounts(rootfs)
    for name in ("etc/resolv.conf", "etc/hostname"):
        (rootfs / name).unlink(missing_ok=True)
    for node in (rootfs / "dev").iterdir():
        if node.is_dir() and not node.is_symlink():
            shutil.rmtree(node)
        else:
            node.unlink()


def _commit(rootfs: Path, recipe: BaseRecipe, digest: str, prefix: str, out: Out) -> None:
    container = capture(["buildah", "from", "scratch"]).strip()
    try:
        mountpoint = capture(["buildah", "mount", container]).strip()
        stream(["cp", "-a", f"{rootfs}/.", mountpoint], prefix, out)  # -a: owners, modes, links, xattrs
        capture(["buildah", "umount", container])
        config = ["buildah", "config", "--cmd", recipe.cmd, "--label", f"{RECIPE_LABEL}={digest}"]
        for key, value in recipe.env:
            config += ["--env", f"{key}={value}"]
        capture([*config, container])
        out(f"{prefix} commit {recipe.image}")
        capture(["buildah", "commit", "--rm", container, recipe.image])
    except BaseException:
        # Best effort: the error that brought us here is the one to report.
        subprocess.run(["buildah", "rm", container], capture_output=True)
        raise


def _refuse_mounts(rootfs: Path) -> None:
    """debootstrap mounts /proc and /sys (or binds the host's /dev) in the target while it works and
    unmounts them when it ends; deleting through a mount still there would delete the host's files."""
    inside = [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4] == str(rootfs) or line.split()[4].startswith(f"{rootfs}/")
    ]
    if inside:
        raise ImagesError(f"{rootfs} still has mounts ({', '.join(inside)}); unmount them and remove it")


def _remove(rootfs: Path) -> None:
    _refuse_mounts(rootfs)
    shutil.rmtree(rootfs, ignore_errors=True)
