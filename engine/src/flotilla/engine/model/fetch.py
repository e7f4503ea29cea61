"""Fetch a model folder from the Hugging Face Hub or from a tar archive over HTTP(S) (`flotilla model fetch`).

The fetch is built for Kubernetes init containers: it writes into a private workspace beside the destination,
checks that the result is a model folder (it holds config.json) and only then renames it into place, so a
crash, a SIGKILL or a full disk never leaves a half-written folder where the engine looks for its model.
A rerun is cheap: a complete destination is left alone, and workspaces left by a killed run are removed.
Only one fetch per destination may run at a time (a second one would remove the first one's workspace).

Imports only the standard library at module level; huggingface_hub loads when an hf:// URI is fetched.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import http.client
import io
import os
import re
import shutil
import socket
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

ACCEPTED_URIS = "hf://org/name[@revision], http(s)://…/model.tar.gz (or .tgz, .tar; optional #sha256=<hex>)"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
NETWORK_TIMEOUT_S = 60.0

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_SHA256_FRAGMENT = re.compile(r"sha256=([0-9a-fA-F]{64})")
_READ_CHUNK = 1 << 20


class FetchError(Exception):
    """A failure to report as one line: exit_code 2 for bad input, 1 for a fetch that went wrong."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class HubSource:
    """hf://org/name[@revision]: a repository snapshot on the Hub (revision None means the default branch)."""

    repo_id: str
    revision: str | None = None


@dataclass(frozen=True)
class ArchiveSource:
    """http(s)://…/model.tar.gz: a tar archive of a model folder; sha256 (lowercase hex) is checked when given."""

    url: str
    sha256: str | None = None


FetchSource = HubSource | ArchiveSource


def parse_fetch_uri(uri: str) -> FetchSource:
    """What a fetch URI names. Pure: no network, no filesystem. Raises FetchError (exit 2) on a URI we can't use."""
    if uri.startswith("hf://"):
        return _parse_hub_uri(uri)
    try:
        scheme = urllib.parse.urlsplit(uri).scheme.lower()
        if scheme in ("http", "https"):
            return _parse_archive_uri(uri)
    except ValueError as error:  # urlsplit and .port refuse malformed hosts and ports
        raise FetchError(f"malformed URL ({error})", exit_code=2) from error
    raise FetchError(f"unsupported URI scheme; accepted: {ACCEPTED_URIS}", exit_code=2)


def _parse_hub_uri(uri: str) -> HubSource:
    repo_id, at, revision = uri.removeprefix("hf://").partition("@")
    if not _REPO_ID.fullmatch(repo_id):
        raise FetchError("expected hf://org/name[@revision]", exit_code=2)
    if at and not revision:
        raise FetchError("empty revision after '@'; expected hf://org/name[@revision]", exit_code=2)
    return HubSource(repo_id=repo_id, revision=revision or None)


def _parse_archive_uri(uri: str) -> ArchiveSource:
    parts = urllib.parse.urlsplit(uri)
    if not parts.hostname:
        raise FetchError("the URL has no host", exit_code=2)
    _ = parts.port  # raises ValueError on a port that is not a number in range
    if parts.username is not None:
        raise FetchError("credentials in the URL are not supported; use a presigned URL", exit_code=2)
    if not parts.path.lower().endswith(ARCHIVE_SUFFIXES):
        raise FetchError("an http(s) URI must name a .tar.gz, .tgz or .tar archive", exit_code=2)
    sha256 = None
    if parts.fragment:
        match = _SHA256_FRAGMENT.fullmatch(parts.fragment)
        if match is None:
            raise FetchError("the only fragment understood is #sha256=<64 hex digits>", exit_code=2)
        sha256 = match.group(1).lower()
    # The fragment is ours (the checksum), not the server's: it is never sent.
    return ArchiveSource(url=urllib.parse.urlunsplit(parts._replace(fragment="")), sha256=sha256)


def redact_uri(uri: str) -> str:
    """The URI as safe to print: no password, no query string (a presigned URL's query is a credential)."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return uri
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    query = "…" if parts.query else ""
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def fetch_model(uri: str, dest: Path) -> bool:
    """Fetch the model folder that `uri` names into `dest`.

    Returns False when `dest` already holds a model folder (nothing is downloaded), True after a fetch.
    Raises FetchError with a one-line cause; nothing is left beside `dest` when it does.
    """
    source = parse_fetch_uri(uri)
    dest = Path(os.path.abspath(dest))
    if not dest.name:
        raise FetchError("--dest must name a folder, not a filesystem root", exit_code=2)
    try:
        _remove_stale_workspaces(dest)
        if is_model_folder(dest):
            return False
        _refuse_occupied_dest(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        workspace = Path(tempfile.mkdtemp(prefix=_workspace_prefix(dest), dir=dest.parent))
        try:
            model_root = _download(source, workspace)
            if not is_model_folder(model_root):
                raise FetchError("not a model folder (no config.json)")
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


def _refuse_occupied_dest(dest: Path) -> None:
    """Only a missing or empty folder is replaced: anything else might be someone's data."""
    if not dest.exists() and not dest.is_symlink():
        return
    if os.path.ismount(dest):
        # rename(2) can't replace a mount point (a volume mounted at --dest); better said before downloading.
        raise FetchError(f"{dest} is a mount point; use a folder inside it as --dest", exit_code=2)
    if dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
        return
    raise FetchError(
        f"{dest} exists and is not a model folder (no config.json); remove it or choose another --dest",
        exit_code=2,
    )


def _download(source: FetchSource, workspace: Path) -> Path:
    """Download into `workspace`; returns the folder inside it that should become the model folder."""
    if isinstance(source, HubSource):
        return _download_from_hub(source, workspace)
    return _download_archive(source, workspace)


def _describe_os_error(error: OSError, dest: Path) -> str:
    if _is_disk_full(error):
        return f"disk full writing {dest}"
    where = f": {error.filename}" if error.filename else ""
    return f"{error.strerror or error}{where}"


def _is_disk_full(error: BaseException) -> bool:
    return any(
        isinstance(cause, OSError) and cause.errno == errno.ENOSPC for cause in _exception_chain(error)
    )


def _exception_chain(error: BaseException) -> Iterator[BaseException]:
    """The error and what caused it: libraries wrap the socket error we want to name in their own types."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)


# --- hf:// --------------------------------------------------------------------------------------------------


def _download_from_hub(source: HubSource, workspace: Path) -> Path:
    import huggingface_hub

    model_root = workspace / "model"
    # huggingface_hub copies HF_ENDPOINT into its constants when first imported; reading it here keeps a value
    # set later (by a test, or by a long-lived process) in force. HF_TOKEN it reads itself, on every request.
    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or None
    try:
        huggingface_hub.snapshot_download(
            source.repo_id,
            revision=source.revision,
            local_dir=model_root,
            # A cache inside the workspace: init containers often have no writable home, and the model folder
            # itself is the copy that is kept.
            cache_dir=workspace / "hub-cache",
            endpoint=endpoint,
        )
    except Exception as error:
        if _is_disk_full(error):
            # Whatever type the library wrapped it in, fetch_model reports it as the full disk it is.
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from error
        raise FetchError(_describe_hub_failure(error, endpoint or DEFAULT_HUB_ENDPOINT)) from error
    _remove_download_metadata(model_root)
    return model_root


def _remove_download_metadata(model_root: Path) -> None:
    """snapshot_download keeps its bookkeeping in local_dir/.cache/huggingface; it is not part of the model."""
    bookkeeping = model_root / ".cache"
    shutil.rmtree(bookkeeping / "huggingface", ignore_errors=True)
    if bookkeeping.is_dir() and not any(bookkeeping.iterdir()):
        bookkeeping.rmdir()


def _describe_hub_failure(error: Exception, endpoint: str) -> str:
    from huggingface_hub import errors

    # Absent from older huggingface_hub releases, where EntryNotFoundError meant the remote case.
    remote_entry_not_found = getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)
    for cause in _exception_chain(error):
        if isinstance(cause, errors.LocalEntryNotFoundError):
            continue  # "not in the local cache": the reason it went to look is further down the chain
        if isinstance(cause, errors.RevisionNotFoundError):
            return "revision not found in the repository"
        if isinstance(cause, errors.GatedRepoError):
            return "repository is gated: accept its terms on the Hub and set HF_TOKEN"
        if isinstance(cause, errors.RepositoryNotFoundError):
            return "repository not found (if it is private, set HF_TOKEN)"
        if isinstance(cause, remote_entry_not_found):
            return "file not found in the repository"
        if isinstance(cause, errors.OfflineModeIsEnabled):
            return "HF_HUB_OFFLINE is set; unset it to download"
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if isinstance(status, int):
            return _describe_http_status(status, endpoint)
        network = _describe_network_error(cause, endpoint)
        if network is not None:
            return network
    return _first_line(str(error)) or type(error).__name__


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


# --- http(s):// archives --------------------------------------------------------------------------------------


def _download_archive(source: ArchiveSource, workspace: Path) -> Path:
    """Stream the archive straight into a folder (no second copy on disk), hashing and counting as it passes."""
    tree = workspace / "tree"
    tree.mkdir()
    host = _host_of(source.url)
    try:
        response = urllib.request.urlopen(source.url, timeout=NETWORK_TIMEOUT_S)
    except urllib.error.HTTPError as error:
        raise FetchError(_describe_http_status(error.code, host)) from error
    except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as error:
        raise FetchError(
            _describe_network_error(error, host) or f"cannot fetch from {host}: {error}"
        ) from error
    with response:
        expected_size = _content_length(response)
        name = PurePosixPath(urllib.parse.urlsplit(source.url).path).name
        reader = _DigestingReader(response, ByteProgress(f"downloading {name}", expected_size))
        try:
            _extract_stream(reader, tree)
            reader.drain()
        except tarfile.FilterError as error:
            raise FetchError(f"refusing archive member: {error}") from error
        except (tarfile.TarError, EOFError) as error:
            # A cut-off download is the likelier story than a bad archive: say so when the byte count shows it.
            _check_size(reader.size, expected_size)
            raise FetchError(f"not a valid tar archive ({error})") from error
        except (ConnectionError, TimeoutError, http.client.HTTPException) as error:
            raise FetchError(f"download from {host} interrupted: {error}") from error
        finally:
            reader.progress.close()
    _check_size(reader.size, expected_size)
    _check_sha256(reader.sha256.hexdigest(), source.sha256)
    return _model_root_in(tree)


def _host_of(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)


def _content_length(response: http.client.HTTPResponse) -> int | None:
    value = response.headers.get("Content-Length")
    return int(value) if value is not None and value.isdigit() else None


def _check_size(received: int, expected: int | None) -> None:
    if expected is not None and received != expected:
        raise FetchError(f"download incomplete: received {received} of {expected} bytes (Content-Length)")


def _check_sha256(actual: str, expected: str | None) -> None:
    if expected is not None and actual != expected:
        raise FetchError(f"sha256 mismatch: expected {expected}, got {actual}")


class _Readable(Protocol):
    def readinto(self, buffer: memoryview, /) -> int: ...


class _DigestingReader(io.RawIOBase):
    """A file view of the response that hashes, counts and reports every byte that passes through it."""

    def __init__(self, raw: _Readable, progress: ByteProgress) -> None:
        super().__init__()
        self.raw = raw
        self.progress = progress
        self.sha256 = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        count = self.raw.readinto(view)
        self.sha256.update(view[:count])
        self.size += count
        self.progress.update(count)
        return count

    def drain(self) -> None:
        """Read what tarfile left (end-of-archive padding): the checksum covers the whole file."""
        while self.read(_READ_CHUNK):
            pass


def _extract_stream(reader: _DigestingReader, tree: Path) -> None:
    # "r|*": a forward-only stream (the response can't seek), compression detected from the first bytes.
    with tarfile.open(fileobj=reader, mode="r|*") as archive:
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


def _model_root_in(tree: Path) -> Path:
    """An archive holds the model folder's files, or one folder that holds them (`tar czf m.tgz my-model/`)."""
    if is_model_folder(tree):
        return tree
    entries = list(tree.iterdir())
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    return tree  # fetch_model reports it is not a model folder


# --- messages and progress -------------------------------------------------------------------------------------


def _describe_http_status(status: int, where: str) -> str:
    if status == 404:
        return f"not found (HTTP 404 from {where})"
    if status in (401, 403):
        return f"access denied (HTTP {status} from {where}); check the credentials (HF_TOKEN for the Hub)"
    return f"HTTP {status} from {where}"


def _describe_network_error(error: BaseException, where: str) -> str | None:
    """A message for a socket-level failure anywhere in `error`'s chain, or None when it is not one."""
    for cause in _exception_chain(error):
        if isinstance(cause, ConnectionRefusedError):
            return f"cannot connect to {where}: connection refused"
        if isinstance(cause, socket.gaierror):
            return f"cannot resolve the host of {where}"
        if isinstance(cause, TimeoutError):
            return f"timed out talking to {where}"
        # httpx re-raises the socket error as its own ConnectError and drops the original from the chain.
        if type(cause).__name__ in ("ConnectError", "ConnectTimeout"):
            return f"cannot connect to {where}: {_strip_errno(_first_line(str(cause))).lower()}"
    return None


def _strip_errno(text: str) -> str:
    return re.sub(r"^\[Errno -?\d+\]\s*", "", text)


class ByteProgress:
    """Download progress on stderr: a live bar on a terminal; in a log (an init container's) a line per tenth,
    since a bar's carriage returns would pile up into one unreadable line."""

    _UNKNOWN_TOTAL_STEP = 256 << 20

    def __init__(self, label: str, total: int | None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self._next_report = self._step()
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, file=sys.stderr)

    def _step(self) -> int:
        return max(self.total // 10, 1) if self.total else self._UNKNOWN_TOTAL_STEP

    def update(self, count: int) -> None:
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
        elif count and self.done >= self._next_report:
            self._next_report = self.done + self._step()
            print(f"{self.label}: {self._describe_done()}", file=sys.stderr)

    def _describe_done(self) -> str:
        if self.total:
            return f"{self.done * 100 // self.total}% of {self.total} bytes"
        return f"{self.done} bytes"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
