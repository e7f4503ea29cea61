"""Build the Dockerfile's targets with buildah, under flotilla.contract's image names, showing each step.

buildah runs with runc (its default crun refuses hybrid cgroups), `--pull=never` (no registry is reachable:
the bases are base.py's stand-ins) and the host's network (pip downloads the dependencies). No `--layers`:
with it, a cached `wheels` stage breaks the targets' `RUN --mount=type=bind,from=wheels`."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flotilla import contract
from flotilla.images.recipe import canonical_image
from flotilla.images.tools import RUNC, Out, capture, stream

IMAGES = {
    "engine": contract.ENGINE_IMAGE,
    "operator": contract.OPERATOR_IMAGE,
    "gateway": contract.GATEWAY_IMAGE,
}
# The engine image downloads CUDA torch and triton wheels (gigabytes): built only when asked for. `envoy`
# is the gateway pod's sidecar (flotilla.images.envoy).
DEFAULT_TARGETS = ("operator", "gateway", "envoy")

_FROM = re.compile(r"^FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", re.IGNORECASE)
_STAGE_REF = re.compile(r"--from=([\w.-]+)|\bfrom=([\w.-]+)")  # COPY --from=, RUN --mount=...,from=
# buildah's step lines: "STEP 2/8: ..." then "COMMIT name" ("[3/3] STEP 2/8: ..." in a multi-stage build).
_STEP = re.compile(r"^((?:\[\d+/\d+\] )?(?:STEP \d+/\d+|COMMIT))\b")


def bud_argv(target: str, context: Path, dockerfile: Path) -> list[str]:
    return [
        "buildah",
        "bud",
        f"--runtime={RUNC}",
        "--pull=never",
        "--network=host",
        "--target",
        target,
        "-t",
        IMAGES[target],
        "-f",
        str(dockerfile),
        str(context),
    ]


def base_images(dockerfile_text: str, targets: list[str]) -> list[str]:
    """The images the targets' stages start FROM (the stages they need included), canonical names in the
    Dockerfile's order: the bases that must exist before buildah runs with `--pull=never`."""
    bases: dict[str, str] = {}  # stage -> what it starts from
    needs: dict[str, set[str]] = {}  # stage -> stages it copies or mounts from
    stage = ""
    for line in dockerfile_text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if match := _FROM.match(line.strip()):
            stage = match.group(2) or str(len(bases))
            bases[stage], needs[stage] = match.group(1), set()
        elif stage:
            needs[stage] |= {a or b for a, b in _STAGE_REF.findall(line)}
    wanted, todo = set(), list(targets)
    while todo:
        name = todo.pop()
        if name in bases and name not in wanted:
            wanted.add(name)
            todo += [bases[name], *needs[name]]
    images = [bases[s] for s in bases if s in wanted and bases[s] not in bases]
    return list(dict.fromkeys(canonical_image(i) for i in images))


@dataclass
class StepClock:
    """Says how long each of buildah's steps took (the commit counts as one), when the next one starts
    and at the end."""

    out: Out
    prefix: str
    clock: Callable[[], float] = time.monotonic
    _step: str | None = field(default=None, init=False)
    _since: float = field(default=0.0, init=False)

    def line(self, text: str) -> None:
        if match := _STEP.match(text):
            now = self.clock()
            self.finish(now)
            self._step, self._since = match.group(1), now

    def finish(self, now: float | None = None) -> None:
        if self._step is not None:
            took = (self.clock() if now is None else now) - self._since
            self.out(f"{self.prefix} -- {self._step} took {took:.1f}s")
            self._step = None


def build_target(target: str, context: Path, dockerfile: Path, out: Out) -> float:
    """Build one target; the seconds it took."""
    prefix, image = f"[{target}]", IMAGES[target]
    previous = [image_id for _, image_id, _ in image_rows([image])]
    steps = StepClock(out, prefix)
    out(f"{prefix} building {image}")
    seconds = stream(bud_argv(target, context, dockerfile), prefix, out, on_line=steps.line)
    steps.finish()
    out(f"{prefix} {image} built in {seconds:.0f}s")
    # The name moved to the new image; the one it leaves untagged would otherwise stay, hundreds of MB
    # per build. Best effort: a container still using it keeps it.
    for image_id in previous:
        if image_id not in [i for _, i, _ in image_rows([image])]:
            subprocess.run(["buildah", "rmi", image_id], capture_output=True)
    return seconds


def image_rows(names: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(name, id, size) of the local images (only those named, when names are given)."""
    rows = []
    for image in json.loads(capture(["buildah", "images", "--json"]) or "[]"):
        for name in image.get("names") or ["<none>"]:
            if names is None or name in names:
                rows.append((name, image["id"][:12], image["size"]))
    return rows


def print_rows(rows: list[tuple[str, str, str]], out: Out) -> None:
    width = max((len(name) for name, _, _ in rows), default=0)
    for name, image_id, size in rows:
        out(f"{name:<{width}}  {image_id}  {size}")
