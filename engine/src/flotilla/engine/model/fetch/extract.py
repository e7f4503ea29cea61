"""Extracting a forward-only tar stream, refusing any member that could write outside the target folder."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from flotilla.fetch_uri import FetchError


def extract_stream(stream: io.RawIOBase, tree: Path) -> None:
    # "r|*": a forward-only stream (the response can't seek), compression detected from the first bytes.
    with tarfile.open(fileobj=stream, mode="r|*") as archive:
        # Our checks give the clear message; the "data" filter is the second line of defence.
        archive.extractall(tree, members=_safe_members(archive), filter="data")


def _safe_members(archive: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    for member in archive:
        problem = unsafe_member_reason(member)
        if problem is not None:
            raise FetchError(f"refusing archive member {member.name!r}: {problem}")
        yield member


def unsafe_member_reason(member: tarfile.TarInfo) -> str | None:
    """Why extracting `member` could write outside the target folder, or None when it can't."""
    path = PurePosixPath(member.name)
    if path.is_absolute():
        return "absolute path"
    if ".." in path.parts:
        return "path contains '..'"
    if member.issym():
        target = PurePosixPath(member.linkname)
        if target.is_absolute() or _climbs_out(path.parent / target):
            return "symbolic link points outside the folder"
    elif member.islnk():
        target = PurePosixPath(member.linkname)  # hard link targets are relative to the archive root
        if target.is_absolute() or _climbs_out(target):
            return "hard link points outside the folder"
    elif not (member.isfile() or member.isdir()):
        return "not a regular file, folder or link"
    return None


def _climbs_out(path: PurePosixPath) -> bool:
    """Whether a relative path, read left to right, ever goes above its starting folder."""
    depth = 0
    for part in path.parts:
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part != ".":
            depth += 1
    return False
