"""What a fetch URI names (hf:// or an http(s) tar archive), the one-line FetchError, and URIs made safe to print.

Pure: no network, no filesystem, standard library only. One copy for every part that reads these URIs: the
engine's fetch (`flotilla model fetch`, flotilla.engine.model.fetch) and LoRA adapters loaded from a URI
(flotilla.engine.lora.source), and the operator's check of a LoRAAdapter's spec.source.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

ACCEPTED_URIS = "hf://org/name[@revision], http(s)://…/model.tar.gz (or .tgz, .tar; optional #sha256=<hex>)"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_SHA256_FRAGMENT = re.compile(r"sha256=([0-9a-fA-F]{64})")


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
    """http(s)://…/model.tar.gz: a tar archive of a model (or adapter) folder; sha256 (lowercase hex) is checked when given."""

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
    if parts.password is None and not parts.query:
        return uri  # nothing to hide: as written (urlunsplit would rewrite some, e.g. file:a -> file:///a)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    query = "…" if parts.query else ""
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))
