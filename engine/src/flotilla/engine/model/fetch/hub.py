"""hf://: a repository snapshot downloaded with huggingface_hub, which loads only when one is fetched."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from flotilla.engine.model.fetch.failures import (
    describe_http_status,
    describe_network_error,
    exception_chain,
    first_line,
    is_disk_full,
)
from flotilla.fetch_uri import FetchError, HubSource

DEFAULT_HUB_ENDPOINT = "https://huggingface.co"


def download_from_hub(source: HubSource, workspace: Path) -> Path:
    """Download the snapshot into `workspace`; returns the folder inside it that holds the model."""
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
        if is_disk_full(error):
            # Whatever type the library wrapped it in, the destination reports it as the full disk it is.
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
    for cause in exception_chain(error):
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
            return describe_http_status(status, endpoint)
        network = describe_network_error(cause, endpoint)
        if network is not None:
            return network
    return first_line(str(error)) or type(error).__name__
