"""Where a load's lora_path is: a folder (a path, or file:///path) read in place, or an hf://org/name[@rev]
or http(s)://…/adapter.tar.gz[#sha256=…] URI, fetched once into the cache folder and read from there.

The fetch is `flotilla model fetch`'s (flotilla.engine.model.fetch, over flotilla.fetch_uri's one parser):
the folder appears whole or not at all (a workspace beside it, renamed into place only once it holds
adapter_config.json), so a refused or interrupted fetch leaves nothing. Each URI has its own folder (named
by the URI's hash, so no secret of a presigned URL shows in a path) and its own lock: concurrent loads of
one URI fetch it once, and a later load of it (another name, or after an unload) reads the folder already
there. The cache is never pruned while the process lives; an engine pod's cache is on its own /tmp.

What the engine shows for a fetched adapter (GET /v1/models' `root`, messages) is the URI without its
secrets (flotilla.fetch_uri.redact_uri): a presigned URL's query is a credential.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from flotilla.engine.lora.errors import LoRAError
from flotilla.engine.model.fetch import ADAPTER_FOLDER, fetch_folder
from flotilla.fetch_uri import FetchError, parse_fetch_uri, redact_uri

ACCEPTED = (
    "a folder (/path or file:///path), hf://org/name[@revision], or http(s)://…/adapter.tar.gz (or .tgz, "
    ".tar; optional #sha256=<64 hex digits>)"
)
FETCHED_SCHEMES = ("hf", "http", "https")


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "flotilla" / "lora-adapters"


@dataclass(frozen=True)
class AdapterSource:
    """A lora_path resolved: the folder to read, and what the engine shows for it (the path, or the URI
    without its secrets); `fetched` when it came from a URI."""

    folder: str
    shown: str
    fetched: bool = False


def scheme_of(lora_path: str) -> str | None:
    """The URI scheme of a lora_path, lowercased; None for a plain path (no `scheme://`)."""
    head, sep, _ = lora_path.partition("://")
    if not sep or not head or not head[0].isalpha() or not all(c.isalnum() or c in "+-." for c in head):
        return None
    return head.lower()


class AdapterSources:
    """Resolves lora_paths, fetching URIs into `cache_dir` (at most one fetch per URI at a time)."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = cache_dir or default_cache_dir()
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def folder_for(self, uri: str) -> Path:
        """The cache folder of a URI: named by its hash, the whole URI (a different checksum or revision is a
        different folder)."""
        return self.cache_dir / hashlib.sha256(uri.encode()).hexdigest()[:32]

    def resolve(self, lora_path: str) -> AdapterSource:
        """The folder to read for `lora_path`, fetched first when it is a URI. A LoRAError (field lora_path)
        names the value (without secrets) and why: an unsupported scheme (with what is accepted), a URI that
        does not parse, or a fetch that failed (then nothing is left in the cache)."""
        scheme = scheme_of(lora_path)
        if scheme is None:
            return AdapterSource(lora_path, lora_path)
        shown = redact_uri(lora_path)
        if scheme == "file":
            parts = urlsplit(lora_path)
            if parts.netloc or not parts.path.startswith("/") or parts.query or parts.fragment:
                raise LoRAError(
                    f"lora_path {shown!r}: not a file URI of an absolute path; accepted: {ACCEPTED}"
                )
            return AdapterSource(parts.path, parts.path)
        if scheme not in FETCHED_SCHEMES:
            raise LoRAError(f"lora_path {shown!r}: scheme {scheme!r} is not supported; accepted: {ACCEPTED}")
        try:
            source = parse_fetch_uri(lora_path)
        except FetchError as exc:
            raise LoRAError(f"lora_path {shown!r}: {exc}; accepted: {ACCEPTED}") from exc
        dest = self.folder_for(lora_path)
        with self._lock_for(str(dest)):
            try:
                fetch_folder(source, dest, ADAPTER_FOLDER)
            except FetchError as exc:
                raise LoRAError(f"lora_path {shown!r}: fetch failed: {exc}") from exc
        return AdapterSource(str(dest), shown, fetched=True)

    def _lock_for(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())
