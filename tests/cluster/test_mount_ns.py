"""The per-container mount namespace wrapper, and mount plans from volumeMounts."""

import os
import subprocess
import sys

import pytest

from flotilla.cluster import mount_ns
from flotilla.cluster.pod_volumes import host_path, mount_plan
from flotilla.cluster.volume_contents import VolumeError


def test_wrap_argv_runs_the_wrapper_under_unshare_and_keeps_the_command_last():
    argv = mount_ns.wrap_argv("/venv/python", [{"source": "/a", "target": "/b"}], "/w", ["sh", "-c", "x"])
    assert argv[:5] == ["unshare", "--mount", "--propagation", "private", "--"]
    assert argv[5:9] == ["/venv/python", "-I", "-m", "flotilla.cluster.mount_ns"]
    assert argv[-4:] == ["--", "sh", "-c", "x"]


def test_parents_mount_before_children():
    mounts = [{"target": "/tmp/a/b"}, {"target": "/tmp"}, {"target": "/tmp/a"}]
    assert [m["target"] for m in mount_ns.order(mounts)] == ["/tmp", "/tmp/a", "/tmp/a/b"]


def test_mount_plan_sub_paths_and_read_only():
    container = {
        "name": "c",
        "volumeMounts": [
            {"name": "cfg", "mountPath": "/etc/app"},
            {"name": "data", "mountPath": "/data", "subPath": "models/x", "readOnly": True},
            {"name": "data", "mountPath": "/scratch"},
        ],
    }
    plan = mount_plan(container, {"cfg": "/s/cfg", "data": "/s/data"}, read_only={"cfg"})
    assert [(m["source"], m["target"], m["readOnly"]) for m in plan] == [
        ("/s/cfg", "/etc/app", True),
        ("/s/data/models/x", "/data", True),
        ("/s/data", "/scratch", False),
    ]
    with pytest.raises(VolumeError, match="names no volume"):
        mount_plan({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, {}, set())
    with pytest.raises(VolumeError, match="stay inside"):
        mount_plan(
            {"volumeMounts": [{"name": "cfg", "mountPath": "/x", "subPath": "../up"}]}, {"cfg": "/s"}, set()
        )


def test_host_path_types(tmp_path):
    made = tmp_path / "made"
    assert host_path({"path": str(made), "type": "DirectoryOrCreate"}) == str(made) and made.is_dir()
    assert host_path({"path": str(tmp_path / "f"), "type": "FileOrCreate"}) and (tmp_path / "f").is_file()
    with pytest.raises(VolumeError, match="not a Directory"):
        host_path({"path": str(tmp_path / "absent"), "type": "Directory"})
    with pytest.raises(VolumeError, match="not a File"):
        host_path({"path": str(made), "type": "File"})


needs_namespaces = pytest.mark.skipif(
    not mount_ns.available(sys.executable)[0], reason="mount namespaces need root and unshare"
)


@needs_namespaces
def test_the_wrapper_binds_read_only_and_execs_in_place(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "hello").write_text("hi")
    target = tmp_path / "inside" / "mnt"
    script = (
        "import os, sys; print(open(sys.argv[1] + '/hello').read(), os.getpid()); "
        "open(sys.argv[1] + '/new', 'w')"
    )
    argv = mount_ns.wrap_argv(
        sys.executable,
        [{"source": str(source), "target": str(target), "readOnly": True}],
        str(tmp_path),
        [sys.executable, "-c", script, str(target)],
    )
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert out.split()[0] == "hi"
    assert int(out.split()[1]) == proc.pid  # unshare and the wrapper exec in place
    assert "Read-only file system" in err
    assert not (target / "hello").exists()  # the bind lived only in the container's namespace
    assert not os.path.ismount(target)


@needs_namespaces
def test_a_missing_command_exits_127_with_the_reason():
    argv = mount_ns.wrap_argv(sys.executable, [], None, ["/no/such/command"])
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 127 and "No such file" in result.stderr


def test_a_mount_that_would_hide_the_commands_installation_is_named():
    protected = ["/tmp/ci/.venv", "/tmp/ci/src", "/usr/lib/python3.11"]
    assert mount_ns.hides("/tmp", protected) == "/tmp/ci/.venv"
    assert mount_ns.hides("/tmp/ci/.venv", protected) == "/tmp/ci/.venv"
    assert mount_ns.hides("/tmp/cache", protected) is None
    assert mount_ns.hides("/mnt/models", protected) is None
    paths = mount_ns.protected_paths([sys.executable])
    assert sys.prefix in paths and os.path.dirname(os.path.realpath(sys.executable)) in paths


@needs_namespaces
def test_a_source_under_an_earlier_mount_is_still_reached(tmp_path):
    """An emptyDir over a parent folder must not hide a later mount's source (the agent's state there)."""
    parent = tmp_path / "parent"
    (parent / "state" / "cfg").mkdir(parents=True)
    (parent / "state" / "cfg" / "key").write_text("value")
    empty = tmp_path / "empty"
    empty.mkdir()
    target = tmp_path / "etc-app"
    mounts = [
        {"source": str(empty), "target": str(parent)},
        {"source": str(parent / "state" / "cfg"), "target": str(target)},
    ]
    script = "import os, sys; print(open(sys.argv[1] + '/key').read(), sorted(os.listdir(sys.argv[2])))"
    argv = mount_ns.wrap_argv(
        sys.executable, mounts, None, [sys.executable, "-c", script, str(target), str(parent)]
    )
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["value", "[]"]  # the source was reached; the parent is the empty dir
