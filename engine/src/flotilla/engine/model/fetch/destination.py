"""--dest's lifecycle: download into a private workspace beside it, rename into place only a whole folder (a
model folder; an adapter folder when the engine fetches a LoRA adapter: lora/source.py).

A crash, a SIGKILL or a full disk never leaves a half-written folder where the engine looks for its model.
A rerun is cheap: a complete destination is left alone, and workspaces left by a killed run are removed.
Only one fetch per destination may run at a time (a second one would remove the first one's workspace).
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flotilla.engine.model.fetch.failures import is_disk_full
from flotilla.fetch_uri import FetchError

Download = Callable[[Path], Path]
"""Downloads into the workspace it is given; returns the folder inside it that should become the model folder."""


@dataclass(frozen=True)
class FolderKind:
    """What a fetched folder must hold to be whole (`marker`, a file at its top), and what messages call it."""

    marker: str
    what: str  # "a model folder"


MODEL_FOLDER = FolderKind("config.json", "a model folder")
ADAPTER_FOLDER = FolderKind("adapter_config.json", "an adapter folder")  # PEFT's


def is_model_folder(folder: Path, kind: FolderKind = MODEL_FOLDER) -> bool:
    return (folder / kind.marker).is_file()


def install_model(dest: Path, download: Download, kind: FolderKind = MODEL_FOLDER) -> bool:
    """Run `download` in a workspace beside `dest`, then rename the folder of `kind` it made to `dest`.

    Returns False when `dest` already holds such a folder (`download` is not called), True after a fetch.
    Raises FetchError with a one-line cause; nothing is left beside `dest` when it does.
    """
    dest = Path(os.path.abspath(dest))
    if not dest.name:
        raise FetchError("--dest must name a folder, not a filesystem root", exit_code=2)
    try:
        _remove_stale_workspaces(dest)
        if is_model_folder(dest, kind):
            return False
        _refuse_occupied_dest(dest, kind)
        dest.parent.mkdir(parents=True, exist_ok=True)
        workspace = Path(tempfile.mkdtemp(prefix=_workspace_prefix(dest), dir=dest.parent))
        try:
            model_root = download(workspace)
            if not is_model_folder(model_root, kind):
                raise FetchError(f"not {kind.what} (no {kind.marker})")
            # rename(2) within one filesystem is atomic (and may replace an empty folder): the engine sees
            # no model folder or the whole one, never part of one.
            os.replace(model_root, dest)
        finally:
            shutil.rmtree(workspace, ignore_errors=True)
    except OSError as error:
        raise FetchError(_describe_os_error(error, dest)) from error
    return True


def _workspace_prefix(dest: Path) -> str:
    return f"{dest.name}.partial-"


def _remove_stale_workspaces(dest: Path) -> None:
    """A run killed mid-fetch (SIGKILL, node loss) leaves its workspace behind; it can't be resumed, only removed."""
    if not dest.parent.is_dir():
        return
    for stale in dest.parent.glob(f"{glob.escape(_workspace_prefix(dest))}*"):
        print(f"removing {stale}, left by an interrupted fetch", file=sys.stderr)
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
        else:
            stale.unlink()


def _refuse_occupied_dest(dest: Path, kind: FolderKind) -> None:
    """Only a missing or empty folder is replaced: anything else might be someone's data."""
    if not dest.exists() and not dest.is_symlink():
        return
    if os.path.ismount(dest):
        # rename(2) can't replace a mount point (a volume mounted at --dest); better said before downloading.
        raise FetchError(f"{dest} is a mount point; use a folder inside it as --dest", exit_code=2)
    if dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
        return
    raise FetchError(
        f"{dest} exists and is not {kind.what} (no {kind.marker}); remove it or choose another --dest",
        exit_code=2,
    )


def _describe_os_error(error: OSError, dest: Path) -> str:
    if is_disk_full(error):
        return f"disk full writing {dest}"
    where = f": {error.filename}" if error.filename else ""
    return f"{error.strerror or error}{where}"
