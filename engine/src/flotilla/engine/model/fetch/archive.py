"""http(s)://: a tar archive streamed straight into a folder, its size and sha256 checked as it passes."""

from __future__ import annotations

import hashlib
import http.client
import io
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Protocol

from flotilla.engine.model.fetch.destination import MODEL_FOLDER, FolderKind, is_model_folder
from flotilla.engine.model.fetch.extract import extract_stream
from flotilla.engine.model.fetch.failures import describe_http_status, describe_network_error
from flotilla.engine.model.fetch.progress import ByteProgress
from flotilla.fetch_uri import ArchiveSource, FetchError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

NETWORK_TIMEOUT_S = 60.0

_READ_CHUNK = 1 << 20


def download_archive(source: ArchiveSource, workspace: Path, kind: FolderKind = MODEL_FOLDER) -> Path:
    """Stream the archive into `workspace` (no second copy on disk), hashing and counting as it passes.

    Returns the folder inside `workspace` that should become the model (or adapter: `kind`) folder.
    """
    tree = workspace / "tree"
    tree.mkdir()
    host = _host_of(source.url)
    try:
        response = urllib.request.urlopen(source.url, timeout=NETWORK_TIMEOUT_S)
    except urllib.error.HTTPError as error:
        raise FetchError(describe_http_status(error.code, host)) from error
    except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as error:
        raise FetchError(
            describe_network_error(error, host) or f"cannot fetch from {host}: {error}"
        ) from error
    with response:
        expected_size = _content_length(response)
        name = PurePosixPath(urllib.parse.urlsplit(source.url).path).name
        reader = _DigestingReader(response, ByteProgress(f"downloading {name}", expected_size))
        try:
            extract_stream(reader, tree)
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
    return _model_root_in(tree, kind)


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


def _model_root_in(tree: Path, kind: FolderKind) -> Path:
    """An archive holds the model folder's files, or one folder that holds them (`tar czf m.tgz my-model/`)."""
    if is_model_folder(tree, kind):
        return tree
    entries = list(tree.iterdir())
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    return tree  # the destination's check reports it is not a model folder
