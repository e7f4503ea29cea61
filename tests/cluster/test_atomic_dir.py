"""The kubelet-style atomic writer: ..data swapped in one rename, top-level names as symlinks."""

import os

from flotilla.cluster import atomic_dir


def test_write_read_update_and_remove_names(tmp_path):
    target = tmp_path / "vol"
    assert atomic_dir.write(target, {"a": (b"1", 0o644), "dir/b": (b"2", 0o600)})
    assert (target / "a").read_bytes() == b"1"
    assert (target / "dir" / "b").read_bytes() == b"2"
    assert os.readlink(target / "a") == "..data/a"
    assert ((target / "dir" / "b").stat().st_mode & 0o777) == 0o600
    first = os.readlink(target / "..data")

    assert not atomic_dir.write(target, {"a": (b"1", 0o644), "dir/b": (b"2", 0o600)})  # unchanged
    assert os.readlink(target / "..data") == first

    assert atomic_dir.write(target, {"a": (b"one", 0o644), "c": (b"3", 0o644)})
    assert (target / "a").read_bytes() == b"one"
    assert (target / "c").read_bytes() == b"3"
    assert not (target / "dir").exists()
    assert not (target / first).exists()  # the old set is gone
    assert atomic_dir.read(target) == {"a": (b"one", 0o644), "c": (b"3", 0o644)}


def test_an_empty_projection_is_an_empty_folder(tmp_path):
    atomic_dir.write(tmp_path / "vol", {})
    assert [p.name for p in (tmp_path / "vol").iterdir() if not p.name.startswith("..")] == []
