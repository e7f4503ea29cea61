"""The installed size of each distribution with everything it depends on, from the current environment.

    .venv/bin/python scripts/dist_footprint.py

Walks `Requires-Dist` (no extras) from flotilla-operator and from flotilla-engine and sums the sizes of
the files each installed distribution records. What an image of each target carries, before the base.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as metadata
import os
import re

from packaging.markers import Marker
from packaging.requirements import Requirement


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(name: str, seen: set[str] | None = None) -> set[str]:
    seen = set() if seen is None else seen
    if canonical(name) in seen:
        return seen
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return seen
    seen.add(canonical(name))
    for line in dist.requires or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not Marker(str(requirement.marker)).evaluate({"extra": ""}):
            continue
        closure(requirement.name, seen)
    return seen


def installed_bytes(name: str) -> int:
    dist = metadata.distribution(name)
    total = 0
    for file in dist.files or []:
        with contextlib.suppress(OSError):
            total += os.path.getsize(str(dist.locate_file(file)))
    return total


if __name__ == "__main__":
    for top in ("flotilla-operator", "flotilla-engine"):
        names = closure(top)
        size = sum(installed_bytes(name) for name in names)
        print(f"{top}: {len(names)} distributions, {size / 2**20:.0f} MiB installed")
