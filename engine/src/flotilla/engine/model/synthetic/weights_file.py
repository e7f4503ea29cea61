"""Writing a .safetensors file that whoever serves the folder can read.

safetensors creates its files with mode 0600 whatever the umask, so a folder written by one user (root,
`flotilla model init`) could not be served by another: the engine's image runs as uid 65532, and a kubelet
enforces it (the local cluster's node agent ran everything as root and never showed it)."""

from __future__ import annotations

import os
from pathlib import Path


def save_weights_file(tensors: dict, path: Path) -> None:
    """tensors to path with one metadata key (safetensors writes several in a random order, which breaks
    byte-equality), readable as any other file the writer makes (0644 under the usual umask)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)
