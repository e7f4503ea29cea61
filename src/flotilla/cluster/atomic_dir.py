"""The kubelet's atomic writer: a volume folder whose files all change at once.

The files live in a timestamped folder `..2024_01_02_03_04_05.123456_xyz`; the symlink `..data` points
at it, and each top-level name is a symlink `name -> ..data/name`. An update writes a new timestamped
folder, points `..data_tmp` at it and renames that over `..data` (rename is atomic), so a reader inside
the container sees either the old set or the new one, never a mix. The links are relative, so they
resolve the same through the bind mount in the container's own mount namespace.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
import shutil
from pathlib import Path

Files = dict[str, tuple[bytes, int]]  # relative path -> (content, mode)
DATA = "..data"


def read(target: Path) -> Files:
    """What the folder holds now, through `..data` (empty when never written)."""
    data = target / DATA
    if not data.is_dir():
        return {}
    files: Files = {}
    for path in data.rglob("*"):
        if path.is_file():
            files[path.relative_to(data).as_posix()] = (path.read_bytes(), path.stat().st_mode & 0o7777)
    return files


def write(target: Path, files: Files) -> bool:
    """Makes target hold exactly `files`; returns False (touching nothing) when it already does."""
    if target.is_dir() and read(target) == files:
        return False
    target.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y_%m_%d_%H_%M_%S.%f")
    fresh = target / f"..{stamp}_{secrets.token_hex(3)}"
    fresh.mkdir()
    for relative, (content, mode) in files.items():
        path = fresh / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode)
    old = os.readlink(target / DATA) if (target / DATA).is_symlink() else None
    tmp = target / "..data_tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(fresh.name)
    os.replace(tmp, target / DATA)
    tops = {relative.split("/", 1)[0] for relative in files}
    for name in tops:
        link = target / name
        if not link.is_symlink():
            link.symlink_to(f"{DATA}/{name}")
    for entry in target.iterdir():
        # Names that left the set, once the new set is in place.
        if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in tops:
            entry.unlink()
    if old and old != fresh.name:
        shutil.rmtree(target / old, ignore_errors=True)
    return True
