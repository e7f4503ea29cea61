"""Where a model's files come from: a spec's model uri turned into a path, volumes and init containers.

hf:// and http(s):// URIs are parsed by flotilla.fetch_uri, the engine's own parser (`flotilla model fetch`
runs in the init container that fetches them), so a uri the operator accepts is one the init container can
fetch. A claim's mount (claim_mount) is shared with spec.engine.lora.adapterClaim (desired/workload.py) and
LoRAAdapter pvc:// sources (desired/lora_adapter.py).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from flotilla.contract import model_fetch_argv
from flotilla.fetch_uri import FetchError, HubSource, parse_fetch_uri, redact_uri
from flotilla.operator.api.v1alpha1 import CLAIM_NAME_MAX, CLAIM_NAME_PATTERN
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired import host_paths

SCHEMES = ("file", "pvc", "hf", "http", "https")
MOUNT_ROOT = "/mnt/models"
ACCEPTED = "use file:///path, pvc://claim/path, hf://org/name[@revision] or https://host/model.tar.gz"


@dataclass(frozen=True)
class MountNames:
    """What one model's mount is called in the pod, so that two models (the served one and a speculative
    draft) never share a volume, a mount point or an init container."""

    volume: str
    root: str  # where claims and fetched models are mounted (host paths keep their own path)
    init_container: str


MODEL = MountNames(volume="model", root=MOUNT_ROOT, init_container="fetch-model")
DRAFT_MODEL = MountNames(volume="draft-model", root="/mnt/draft-models", init_container="fetch-draft-model")
# spec.engine.lora.adapterClaim: a claim of LoRA adapters, never fetched (so no init container).
LORA_ADAPTER_CLAIM = MountNames(volume="lora-adapter-claim", root="/mnt/lora-adapters", init_container="")


class ModelUriError(ValueError):
    """A uri that names no model we can mount; the message says what is wrong and what is accepted."""


@dataclass(frozen=True)
class ModelUri:
    scheme: str
    location: str  # file: absolute path; pvc: claim name; hf: org/name[@revision]; http(s): the whole uri
    sub_path: str = ""  # pvc only: the model folder inside the claim


def parse_claim_uri(uri: str) -> tuple[str, str]:
    """pvc://claim/path as (claim, path inside the claim, normalized). A ValueError (ModelUriError) says
    what is wrong: no claim, no path, a claim name Kubernetes refuses, or a path that leaves the claim."""
    parts = urlsplit(uri)
    sub_path = posixpath.normpath(parts.path.strip("/")) if parts.path.strip("/") else ""
    if not parts.netloc or sub_path in ("", ".") or parts.query or parts.fragment:
        raise ModelUriError("a pvc uri needs a claim and a path, like pvc://models/llama-3-8b")
    claim = parts.netloc
    if len(claim) > CLAIM_NAME_MAX or not re.fullmatch(CLAIM_NAME_PATTERN, claim):
        raise ModelUriError(
            f"claim {claim!r} is not a PersistentVolumeClaim name (lowercase letters, digits, '-' and '.')"
        )
    if sub_path == ".." or sub_path.startswith("../"):
        raise ModelUriError(f"path {parts.path!r} leaves the claim")
    return claim, sub_path


def parse_model_uri(uri: str) -> ModelUri:
    shown = redact_uri(uri)
    try:
        parts = urlsplit(uri)
    except ValueError as exc:  # a malformed host or port
        raise ModelUriError(f"{shown!r}: {exc}; {ACCEPTED}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        named = f"'{parts.scheme}'" if parts.scheme else "no scheme"
        raise ModelUriError(f"unsupported uri scheme {named} in {shown!r}; {ACCEPTED}")
    if scheme == "file":
        if parts.netloc:
            raise ModelUriError(f"{shown!r}: a file uri needs an absolute path, like file:///models/name")
        path = host_paths.normalize(parts.path or "/")  # the string checked (validation) is the one mounted
        if path == "/":
            raise ModelUriError(f"{shown!r}: a file uri needs a model folder, like file:///models/name")
        return ModelUri("file", path)
    if scheme == "pvc":
        try:
            claim, sub_path = parse_claim_uri(uri)
        except ModelUriError as exc:
            raise ModelUriError(f"{shown!r}: {exc}") from None
        return ModelUri("pvc", claim, sub_path)
    # hf:// and http(s)://: the engine's parser, which the init container's `flotilla model fetch` runs.
    try:
        source = parse_fetch_uri(uri)
    except FetchError as exc:
        what = "an hf uri names one repository" if scheme == "hf" else "an http(s) uri names a model archive"
        raise ModelUriError(f"{shown!r}: {what}: {exc}") from None
    if isinstance(source, HubSource):
        location = source.repo_id + (f"@{source.revision}" if source.revision else "")
        # The location becomes a path (under hf_cache_dir, or the fetch's volume): a revision with `.` or
        # `..` segments, `//` or a trailing `/` could walk out of it. No git ref has them, so none is lost.
        if posixpath.normpath(location) != location:
            raise ModelUriError(
                f"{shown!r}: revision {source.revision!r} has '.' or '..' segments, '//' or a trailing '/'; "
                "an hf uri names one repository: hf://org/name[@revision]"
            )
        return ModelUri("hf", location)
    return ModelUri(scheme, uri)


@dataclass
class ModelMount:
    path: str  # the --model argument inside the container
    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    init_containers: list[dict] = field(default_factory=list)


def model_mount(model: ModelUri, config: OperatorConfig, image: str, names: MountNames = MODEL) -> ModelMount:
    """Volumes, mounts and the in-container path for a parsed model uri, under `names`."""
    if model.scheme == "file":
        return _host_path(model.location, names)
    if model.scheme == "pvc":
        return claim_mount(model.location, model.sub_path, names)
    if model.scheme == "hf" and config.hf_cache_dir:
        # The platform's own cache folder, so no tenant root applies; the repository must stay in it all the
        # same (parse_model_uri refuses a location that could leave it; this holds for any ModelUri).
        cache = host_paths.normalize(config.hf_cache_dir)
        path = host_paths.normalize(posixpath.join(cache, model.location))
        if path == cache or not host_paths.allowed(path, [cache]):
            raise ModelUriError(f"'hf://{model.location}': {path} is not under the hf cache folder {cache}")
        return _host_path(path, names)
    return _fetched(model, image, names)


def claim_mount(claim: str, sub_path: str, names: MountNames) -> ModelMount:
    """A PersistentVolumeClaim mounted read-only at `<names.root>/<claim>`; the path is `sub_path` in it
    (the claim's top when empty)."""
    mount_path = f"{names.root}/{claim}"
    return ModelMount(
        path=posixpath.join(mount_path, sub_path) if sub_path else mount_path,
        volumes=[{"name": names.volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
        mounts=[{"name": names.volume, "mountPath": mount_path, "readOnly": True}],
    )


def _fetched(model: ModelUri, image: str, names: MountNames) -> ModelMount:
    """An init container fetches the model into a pod-local volume (hf:// on a real cluster, http(s)://)."""
    if model.scheme == "hf":
        uri, path = f"hf://{model.location}", f"{names.root}/hf/{model.location}"
    else:
        uri, path = model.location, f"{names.root}/download/model"
    return ModelMount(
        path=path,
        volumes=[{"name": names.volume, "emptyDir": {}}],
        mounts=[{"name": names.volume, "mountPath": names.root, "readOnly": True}],
        init_containers=[
            {
                "name": names.init_container,
                "image": image,
                "command": model_fetch_argv(uri, path),
                "volumeMounts": [{"name": names.volume, "mountPath": names.root}],
            }
        ],
    )


def _host_path(path: str, names: MountNames) -> ModelMount:
    # Mounted at the same path, so the command reads the same in the image and in the local cluster,
    # whose node agent runs the command on the host itself.
    return ModelMount(
        path=path,
        volumes=[{"name": names.volume, "hostPath": {"path": path, "type": "Directory"}}],
        mounts=[{"name": names.volume, "mountPath": path, "readOnly": True}],
    )
