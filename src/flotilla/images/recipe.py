"""What the stand-in base images are made of: the one place the Debian suite and the packages are pinned.

The Dockerfile's bases (`python:3.11-slim-bookworm`, `python:3.11-bookworm`) cannot be pulled on this
project's machines, so base.py makes look-alikes from Debian's own packages under the same names. Each
image carries the digest of its recipe in a label; a recipe that changes (a package, the suite, the set-up
script, the machine's CA certificates baked in) gets a new digest and the image is made again.
Standard library only: the tests check the digests without buildah.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

SUITE = "bookworm"  # the official images' Debian release; its python3 is 3.11, as the tags say
VARIANT = "minbase"  # essential and required packages only: apt, dpkg, passwd (useradd), no init
RECIPE_LABEL = "dev.flotilla.base-recipe"

# What the slim image has that a minbase Debian lacks: Python with venv and pip, `python` (the Dockerfile
# runs `python -m venv`), and CA certificates for pip's downloads.
SLIM_PACKAGES = ("ca-certificates", "python3", "python3-venv", "python3-pip", "python-is-python3")
# The full image adds a C toolchain: Triton compiles its launchers with gcc at run time (the engine image).
FULL_PACKAGES = (*SLIM_PACKAGES, "gcc", "libc6-dev", "python3-dev")

# Run in the chroot after the packages are in: make Debian's Python look like the official images' where
# the Dockerfile relies on it.
SETUP = """\
# The official images' Python lives under /usr/local and the Dockerfile byte-compiles
# /usr/local/lib/python3.11; Debian's lives under /usr/lib, so the (empty) directory is made.
mkdir -p /usr/local/lib/python3.11
# The official images are not marked externally managed (PEP 668): pip may install there.
rm -f /usr/lib/python3*/EXTERNALLY-MANAGED
# The machine's own CA certificates (copied to /usr/local/share/ca-certificates): pip in the builds
# reaches the index through them.
update-ca-certificates
apt-get clean
rm -rf /var/lib/apt/lists/*
"""

# The official images' environment (their PATH puts /usr/local/bin first; LANG for UTF-8 I/O).
ENV = (
    ("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
    ("LANG", "C.UTF-8"),
)
CMD = "python3"


@dataclass(frozen=True)
class BaseRecipe:
    image: str  # the name a Dockerfile's FROM finds (normalised: docker.io/library/...)
    packages: tuple[str, ...]
    suite: str = SUITE
    variant: str = VARIANT
    setup: str = SETUP
    env: tuple[tuple[str, str], ...] = ENV
    cmd: str = CMD

    def script(self) -> str:
        """The chroot's shell script: the packages, then SETUP."""
        install = (
            "set -eu\n"
            "export DEBIAN_FRONTEND=noninteractive\n"
            "apt-get update -q\n"
            f"apt-get install -y -q --no-install-recommends {' '.join(self.packages)}\n"
        )
        return install + self.setup

    def digest(self, certificates: Iterable[bytes] = ()) -> str:
        """sha256 of everything the image is made from; the certificates are the machine's CA files."""
        recipe = asdict(self)
        recipe["certificates"] = sorted(hashlib.sha256(c).hexdigest() for c in certificates)
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def canonical_image(name: str) -> str:
    """An image name as buildah stores it: `python:3.11` is `docker.io/library/python:3.11`."""
    first, _, rest = name.partition("/")
    if not rest:
        return f"docker.io/library/{name}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{name}"
    return name


SLIM = BaseRecipe(canonical_image("python:3.11-slim-bookworm"), SLIM_PACKAGES)
FULL = BaseRecipe(canonical_image("python:3.11-bookworm"), FULL_PACKAGES)
BASES = {recipe.image: recipe for recipe in (SLIM, FULL)}
