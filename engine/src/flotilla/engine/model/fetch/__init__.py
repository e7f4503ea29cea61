"""`flotilla model fetch`: a model folder from the Hugging Face Hub or from a tar archive over HTTP(S).

Built for Kubernetes init containers: the folder appears at --dest whole or not at all (destination.py).
Imports only the standard library at module level; huggingface_hub loads when an hf:// URI is fetched.
"""

from __future__ import annotations

from pathlib import Path

from flotilla.engine.model.fetch.archive import download_archive
from flotilla.engine.model.fetch.destination import ADAPTER_FOLDER, MODEL_FOLDER, FolderKind, install_model
from flotilla.engine.model.fetch.hub import download_from_hub
from flotilla.fetch_uri import (
    ACCEPTED_URIS,
    ArchiveSource,
    FetchError,
    FetchSource,
    HubSource,
    parse_fetch_uri,
    redact_uri,
)

__all__ = [
    "ACCEPTED_URIS",
    "ADAPTER_FOLDER",
    "MODEL_FOLDER",
    "ArchiveSource",
    "FetchError",
    "FetchSource",
    "FolderKind",
    "HubSource",
    "fetch_folder",
    "fetch_model",
    "parse_fetch_uri",
    "redact_uri",
]


def fetch_model(uri: str, dest: Path) -> bool:
    """Fetch the model folder that `uri` names into `dest`.

    Returns False when `dest` already holds a model folder (nothing is downloaded), True after a fetch.
    Raises FetchError with a one-line cause; nothing is left beside `dest` when it does.
    """
    source = parse_fetch_uri(uri)  # a bad URI is refused before the filesystem is touched
    return fetch_folder(source, dest, MODEL_FOLDER)


def fetch_folder(source: FetchSource, dest: Path, kind: FolderKind) -> bool:
    """Fetch the folder `source` names into `dest`, which must then hold `kind`'s marker file (a model's
    config.json, an adapter's adapter_config.json). Returns False when `dest` already holds one (nothing is
    downloaded). Raises FetchError; nothing is left beside `dest` when it does. One fetch per `dest` at a
    time (the caller's to ensure)."""

    def download(workspace: Path) -> Path:
        if isinstance(source, HubSource):
            return download_from_hub(source, workspace)
        return download_archive(source, workspace, kind)

    return install_model(dest, download, kind)
