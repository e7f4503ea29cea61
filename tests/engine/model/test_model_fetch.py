"""`flotilla model fetch`: against a fake Hub and archive server on 127.0.0.1 that this file starts itself.

The fake Hub answers what huggingface_hub's snapshot_download asks for: GET /api/models/{repo}/revision/{rev}
(the commit sha), GET /api/models/{repo}/tree/{commit} (the file list) and HEAD/GET
/{repo}/resolve/{commit}/{file} (ETag, X-Repo-Commit, Content-Length, then the bytes).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import re
import socket
import subprocess
import sys
import tarfile
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flotilla.cli import main
from flotilla.engine.model.fetch import ArchiveSource, FetchError, HubSource, parse_fetch_uri

COMMIT = hashlib.sha1(b"tiny model, first commit").hexdigest()
MODEL_FILES = {
    "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}).encode(),
    "tokenizer.json": b'{"placeholder": "not a real tokenizer"}',
    "model.safetensors": bytes(range(256)) * 64,
    "original/params.json": b'{"dim": 64}',
}
ERROR_PREFIX = "flotilla model fetch: "


@dataclass
class FakeServer:
    """What the server serves, and what it was asked for."""

    url: str = ""
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    archives: dict[str, bytes] = field(default_factory=dict)
    # archive name -> Content-Length to announce instead of the real one (a cut-off download)
    announced_lengths: dict[str, int] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    revisions: list[str] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)


def _git_blob_sha(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _handler_for(state: FakeServer) -> type[BaseHTTPRequestHandler]:
    revision_route = re.compile(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)")
    tree_route = re.compile(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)")
    resolve_route = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")
    archive_route = re.compile(r"/archives/([^/]+)")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(with_body=True)

        def do_HEAD(self) -> None:
            self._answer(with_body=False)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 -- the base class's name
            pass  # keep pytest's output for the assertions

        def _answer(self, with_body: bool) -> None:
            path = urllib.parse.urlsplit(self.path).path
            state.requests.append(f"{self.command} {path}")
            state.authorizations.append(self.headers.get("Authorization"))
            if match := revision_route.fullmatch(path):
                self._repo_info(match.group(1), urllib.parse.unquote(match.group(2)))
            elif match := tree_route.fullmatch(path):
                self._tree(match.group(1))
            elif match := resolve_route.fullmatch(path):
                self._file(match.group(1), urllib.parse.unquote(match.group(3)), with_body)
            elif (match := archive_route.fullmatch(path)) and match.group(1) in state.archives:
                self._archive(match.group(1), with_body)
            else:
                self._send(404, b"not found", {})

        def _repo_info(self, repo_id: str, revision: str) -> None:
            state.revisions.append(revision)
            if repo_id not in state.repos:
                return self._repo_not_found()
            siblings = [{"rfilename": name} for name in state.repos[repo_id]]
            self._send_json({"id": repo_id, "sha": COMMIT, "siblings": siblings})

        def _tree(self, repo_id: str) -> None:
            if repo_id not in state.repos:
                return self._repo_not_found()
            entries = [
                {"type": "file", "path": name, "size": len(content), "oid": _git_blob_sha(content)}
                for name, content in state.repos[repo_id].items()
            ]
            self._send_json(entries)

        def _file(self, repo_id: str, filename: str, with_body: bool) -> None:
            content = state.repos.get(repo_id, {}).get(filename)
            if content is None:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
            headers = {"ETag": f'"{_git_blob_sha(content)}"', "X-Repo-Commit": COMMIT}
            self._send(200, content if with_body else b"", headers, length=len(content))

        def _archive(self, name: str, with_body: bool) -> None:
            content = state.archives[name]
            length = state.announced_lengths.get(name, len(content))
            self._send(200, content if with_body else b"", {}, length=length)

        def _repo_not_found(self) -> None:
            headers = {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}
            self._send(404, b'{"error": "Repository not found"}', headers)

        def _send_json(self, payload: object) -> None:
            self._send(200, json.dumps(payload).encode(), {"Content-Type": "application/json"})

        def _send(self, status: int, body: bytes, headers: dict[str, str], length: int | None = None) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            self.wfile.write(body)

    return Handler


@pytest.fixture
def server() -> Iterator[FakeServer]:
    state = FakeServer()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(state))
    httpd.daemon_threads = True
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    # A short poll interval only makes shutdown() at teardown return promptly.
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield state
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture(autouse=True)
def hub_env(server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point huggingface_hub at the fake Hub, and keep it away from the user's cache, token and telemetry."""
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: a developer's setting must not leak in.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    """The model folder to fetch into; its parent holds nothing else, so leftovers are easy to see."""
    return tmp_path / "models" / "tiny"


def run_fetch(capsys: pytest.CaptureFixture[str], uri: str, dest: Path) -> tuple[int, str, list[str]]:
    """Run the CLI in-process: the exit code, stdout, and the error lines on stderr."""
    code = main(["model", "fetch", uri, "--dest", str(dest)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, [line for line in err.splitlines() if line.startswith(ERROR_PREFIX)]


def beside(dest: Path) -> list[str]:
    """What is in dest's parent folder (a partial folder left behind would show here)."""
    return sorted(entry.name for entry in dest.parent.iterdir()) if dest.parent.exists() else []


def files_in(folder: Path) -> dict[str, bytes]:
    return {
        path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()
    }


def tar_archive(
    files: dict[str, bytes],
    *,
    top: str | None = None,
    compress: bool = True,
    extra: Sequence[tarfile.TarInfo] = (),
) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if compress else "w") as archive:
        for name, content in files.items():
            member = tarfile.TarInfo(f"{top}/{name}" if top else name)
            member.size = len(content)
            archive.addfile(member, io.BytesIO(content))
        for member in extra:
            archive.addfile(member, io.BytesIO(b"x" * member.size) if member.isfile() else None)
    return buffer.getvalue()


def free_port() -> int:
    """A port nothing listens on (bound, then released), for connection-refused cases."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- parsing ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("hf://org/name", HubSource("org/name", None)),
        ("hf://org/name@v1.0", HubSource("org/name", "v1.0")),
        ("hf://Org-1/name_2.5@refs/pr/3", HubSource("Org-1/name_2.5", "refs/pr/3")),
        ("https://example.com/m/model.tar.gz", ArchiveSource("https://example.com/m/model.tar.gz")),
        ("http://h:8080/a.tgz?sig=1", ArchiveSource("http://h:8080/a.tgz?sig=1")),
        ("https://h/a.tar#sha256=" + "AB" * 32, ArchiveSource("https://h/a.tar", "ab" * 32)),
    ],
)
def test_parse_fetch_uri(uri: str, expected: object) -> None:
    assert parse_fetch_uri(uri) == expected


@pytest.mark.parametrize(
    "uri",
    ["s3://x/y", "/models/x", "hf://just-a-name", "hf://org/name@", "hf://a/b/c", "https://h/model.zip",
     "https://h/model.tar.gz#md5=abc", "https://h/model.tar.gz#sha256=abc", "https:///model.tar.gz",
     "http://h:99999/m.tar", "https://user:secret@h/m.tar.gz"],
)  # fmt: skip
def test_parse_fetch_uri_refuses_bad_input_with_exit_code_2(uri: str) -> None:
    with pytest.raises(FetchError) as caught:
        parse_fetch_uri(uri)
    assert caught.value.exit_code == 2


# --- hf:// ----------------------------------------------------------------------------------------------------


def test_hf_fetch_writes_the_repository_files_and_nothing_else(
    server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server.repos["org/tiny"] = MODEL_FILES
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token")
    code, out, errors = run_fetch(capsys, "hf://org/tiny", dest)
    assert (code, errors) == (0, [])
    assert f"into {dest}" in out
    assert files_in(dest) == MODEL_FILES  # no .cache bookkeeping either
    assert beside(dest) == ["tiny"]
    assert set(server.authorizations) == {"Bearer hf_fake_token"}


@pytest.mark.parametrize(
    ("suffix", "requested"), [("", "main"), ("@v1.0", "v1.0"), ("@refs/pr/3", "refs/pr/3")]
)
def test_hf_fetch_asks_for_the_revision_in_the_uri(
    server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str], suffix: str, requested: str
) -> None:
    server.repos["org/tiny"] = MODEL_FILES
    code, _, errors = run_fetch(capsys, f"hf://org/tiny{suffix}", dest)
    assert (code, errors) == (0, [])
    assert server.revisions == [requested]


def test_hf_repository_not_found(dest: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, errors = run_fetch(capsys, "hf://org/missing", dest)
    assert code == 1
    assert len(errors) == 1
    assert "hf://org/missing" in errors[0] and "not found" in errors[0]
    assert not dest.exists()
    assert beside(dest) == []


def test_hf_repository_without_config_json_is_not_a_model_folder(
    server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.repos["org/weights-only"] = {"model.safetensors": b"\0" * 64}
    code, _, errors = run_fetch(capsys, "hf://org/weights-only", dest)
    assert code == 1
    assert errors == [f"{ERROR_PREFIX}hf://org/weights-only: not a model folder (no config.json)"]
    assert beside(dest) == []


def test_hf_connection_refused(dest: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    code, _, errors = run_fetch(capsys, "hf://org/tiny", dest)
    assert code == 1
    assert len(errors) == 1
    assert "hf://org/tiny" in errors[0] and "connection refused" in errors[0]
    assert beside(dest) == []


# --- http(s):// archives --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "top", "compress"),
    [("model.tar.gz", None, True), ("model.tgz", "tiny-model", True), ("model.tar", "tiny-model", False)],
)
def test_archive_fetch_extracts_the_model_folder(
    server: FakeServer,
    dest: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    top: str | None,
    compress: bool,
) -> None:
    archive = tar_archive(MODEL_FILES, top=top, compress=compress)
    server.archives[name] = archive
    digest = hashlib.sha256(archive).hexdigest()
    code, _, errors = run_fetch(capsys, f"{server.url}/archives/{name}#sha256={digest}", dest)
    assert (code, errors) == (0, [])
    assert files_in(dest) == MODEL_FILES  # a single top-level folder is stripped
    assert beside(dest) == ["tiny"]


def test_archive_with_the_wrong_sha256_is_refused(
    server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.archives["model.tar.gz"] = tar_archive(MODEL_FILES)
    wrong = "0" * 64
    code, _, errors = run_fetch(capsys, f"{server.url}/archives/model.tar.gz#sha256={wrong}", dest)
    assert code == 1
    assert len(errors) == 1
    assert "/archives/model.tar.gz" in errors[0] and "sha256 mismatch" in errors[0] and wrong in errors[0]
    assert beside(dest) == []


def test_archive_shorter_than_its_content_length_is_refused(
    server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = tar_archive(MODEL_FILES)
    server.archives["model.tar.gz"] = archive
    server.announced_lengths["model.tar.gz"] = len(archive) + 1000
    code, _, errors = run_fetch(capsys, f"{server.url}/archives/model.tar.gz", dest)
    assert code == 1
    assert len(errors) == 1 and "download incomplete" in errors[0]
    assert beside(dest) == []


def test_archive_without_config_json_is_not_a_model_folder(
    server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.archives["weights.tar.gz"] = tar_archive({"a/model.safetensors": b"0", "b/readme": b"1"})
    code, _, errors = run_fetch(capsys, f"{server.url}/archives/weights.tar.gz", dest)
    assert code == 1
    assert len(errors) == 1 and errors[0].endswith("not a model folder (no config.json)")
    assert beside(dest) == []


def test_archive_not_found(server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"{server.url}/archives/absent.tar.gz"
    code, _, errors = run_fetch(capsys, uri, dest)
    assert code == 1
    assert errors == [f"{ERROR_PREFIX}{uri}: not found (HTTP 404 from {uri.split('/')[2]})"]
    assert beside(dest) == []


def test_archive_connection_refused(dest: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"http://127.0.0.1:{free_port()}/model.tar.gz"
    code, _, errors = run_fetch(capsys, uri, dest)
    assert code == 1
    assert len(errors) == 1 and uri in errors[0] and "connection refused" in errors[0]
    assert beside(dest) == []


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type = kind
    member.linkname = linkname
    member.size = 4 if kind == tarfile.REGTYPE else 0
    return member


@pytest.mark.parametrize(
    ("member", "reason"),
    [
        (_member("../evil.txt"), "path contains '..'"),
        (_member("tiny/../../evil.txt"), "path contains '..'"),
        (_member("/tmp/evil.txt"), "absolute path"),
        (_member("escape", tarfile.SYMTYPE, "../../evil.txt"), "symbolic link points outside"),
        (_member("sub/escape", tarfile.SYMTYPE, "/etc/passwd"), "symbolic link points outside"),
        (_member("hard", tarfile.LNKTYPE, "../evil.txt"), "hard link points outside"),
        (_member("fifo", tarfile.FIFOTYPE), "not a regular file, folder or link"),
    ],
)
def test_archive_members_that_could_escape_are_refused(
    server: FakeServer,
    dest: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    member: tarfile.TarInfo,
    reason: str,
) -> None:
    server.archives["model.tar.gz"] = tar_archive(MODEL_FILES, extra=[member])
    code, _, errors = run_fetch(capsys, f"{server.url}/archives/model.tar.gz", dest)
    assert code == 1
    assert len(errors) == 1 and "refusing archive member" in errors[0] and reason in errors[0]
    assert beside(dest) == []
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "models" / "evil.txt").exists()


def test_archive_links_that_stay_inside_are_kept(
    server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    links = [_member("tiny-model/original/config.json", tarfile.SYMTYPE, "../config.json")]
    server.archives["model.tar.gz"] = tar_archive(MODEL_FILES, top="tiny-model", extra=links)
    code, _, errors = run_fetch(capsys, f"{server.url}/archives/model.tar.gz", dest)
    assert (code, errors) == (0, [])
    assert (dest / "original" / "config.json").read_bytes() == MODEL_FILES["config.json"]


# --- bad input, reruns, full disks ------------------------------------------------------------------------


def test_unknown_scheme_exits_2_with_one_line_naming_the_accepted_uris(tmp_path: Path) -> None:
    dest = tmp_path / "models" / "tiny"
    result = subprocess.run(
        [sys.executable, "-m", "flotilla.cli", "model", "fetch", "s3://x/y", "--dest", str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{ERROR_PREFIX}s3://x/y: ")
    assert "hf://org/name[@revision]" in lines[0] and "http(s)://" in lines[0]
    assert not dest.parent.exists()


def test_rerun_over_a_complete_dest_downloads_nothing(
    server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.repos["org/tiny"] = MODEL_FILES
    assert run_fetch(capsys, "hf://org/tiny", dest)[0] == 0
    asked_before = len(server.requests)
    code, out, errors = run_fetch(capsys, "hf://org/tiny", dest)
    assert (code, errors) == (0, [])
    assert "already holds a model folder" in out
    assert len(server.requests) == asked_before
    assert files_in(dest) == MODEL_FILES


def test_rerun_after_an_interrupted_fetch_removes_its_partial_folder(
    server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.repos["org/tiny"] = MODEL_FILES
    stale = dest.parent / "tiny.partial-k1ll3d"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "config.json").write_text("{}")
    code, _, errors = run_fetch(capsys, "hf://org/tiny", dest)
    assert (code, errors) == (0, [])
    assert beside(dest) == ["tiny"]
    assert files_in(dest) == MODEL_FILES


def test_dest_with_other_content_is_left_alone(
    server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.repos["org/tiny"] = MODEL_FILES
    dest.mkdir(parents=True)
    (dest / "notes.txt").write_text("mine")
    code, _, errors = run_fetch(capsys, "hf://org/tiny", dest)
    assert code == 2
    assert len(errors) == 1 and "not a model folder" in errors[0]
    assert files_in(dest) == {"notes.txt": b"mine"}
    assert server.requests == []


def test_empty_dest_folder_is_filled(
    server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.repos["org/tiny"] = MODEL_FILES
    dest.mkdir(parents=True)  # as a volume mount point would be
    code, _, errors = run_fetch(capsys, "hf://org/tiny", dest)
    assert (code, errors) == (0, [])
    assert files_in(dest) == MODEL_FILES


def test_mount_point_dest_is_refused_before_downloading(
    server: FakeServer, dest: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server.repos["org/tiny"] = MODEL_FILES
    dest.mkdir(parents=True)
    monkeypatch.setattr("os.path.ismount", lambda path: Path(path) == dest)
    code, _, errors = run_fetch(capsys, "hf://org/tiny", dest)
    assert code == 2
    assert len(errors) == 1 and "is a mount point" in errors[0]
    assert server.requests == []


def _fill_the_disk(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("source", ["hf", "archive"])
def test_disk_full_is_one_line_and_leaves_nothing_behind(
    server: FakeServer,
    dest: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    source: str,
) -> None:
    server.repos["org/tiny"] = MODEL_FILES
    server.archives["model.tar.gz"] = tar_archive(MODEL_FILES)
    if source == "hf":
        uri = "hf://org/tiny"
        monkeypatch.setattr("huggingface_hub.file_download.http_get", _fill_the_disk)
    else:
        uri = f"{server.url}/archives/model.tar.gz"
        monkeypatch.setattr(tarfile.TarFile, "makefile", _fill_the_disk)
    code, _, errors = run_fetch(capsys, uri, dest)
    assert code == 1
    assert errors == [f"{ERROR_PREFIX}{uri}: disk full writing {dest}"]
    assert beside(dest) == []
