"""Where a model's files come from: a spec's model uri turned into a path, volumes and init containers."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from flotilla.contract import model_fetch_argv
from flotilla.operator.config import OperatorConfig

SCHEMES = ("file", "pvc", "hf", "http", "https")
MOUNT_ROOT = "/mnt/models"


@dataclass(frozen=True)
class MountNames:
    """What one model's mount is called in the pod, so that two models (the served one and a speculative
    draft) never share a volume, a mount point or an init container."""

    volume: str
    root: str  # where claims and fetched models are mounted (host paths keep their own path)
    init_container: str


MODEL = MountNames(volume="model", root=MOUNT_ROOT, init_container="fetch-model")
DRAFT_MODEL = MountNames(volume="draft-model", root="/mnt/draft-models", init_container="fetch-draft-model")


class ModelUriError(ValueError):
    """A uri that names no model we can mount; the message says what is wrong and what is accepted."""


@dataclass(frozen=True)
class ModelUri:
    scheme: str
    location: str  # file: absolute path; pvc: claim name; hf: org/name[@revision]; http(s): the whole uri
    sub_path: str = ""  # pvc only: the model folder inside the claim


def parse_model_uri(uri: str) -> ModelUri:
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        shown = f"'{parts.scheme}'" if parts.scheme else "no scheme"
        raise ModelUriError(
            f"unsupported uri scheme {shown} in {uri!r}; use file:///path, pvc://claim/path, hf://org/name "
            "or https://host/model.tar.gz"
        )
    if scheme == "file":
        if parts.netloc:
            raise ModelUriError(f"{uri!r}: a file uri needs an absolute path, like file:///models/name")
        path = posixpath.normpath(parts.path or "/")
        if path == "/":
            raise ModelUriError(f"{uri!r}: a file uri needs a model folder, like file:///models/name")
        return ModelUri("file", path)
    if scheme == "pvc":
        sub_path = parts.path.strip("/")
        if not parts.netloc or not sub_path:
            raise ModelUriError(f"{uri!r}: a pvc uri needs a claim and a path, like pvc://models/llama-3-8b")
        return ModelUri("pvc", parts.netloc, sub_path)
    if scheme in ("http", "https"):
        if not parts.netloc or not parts.path.endswith((".tar.gz", ".tgz", ".tar")):
            raise ModelUriError(f"{uri!r}: an http(s) uri names a .tar.gz, .tgz or .tar of a model folder")
        return ModelUri(scheme, uri)
    name = f"{parts.netloc}{parts.path}".strip("/")
    if name.count("/") != 1 or not all(name.split("/")):
        raise ModelUriError(f"{uri!r}: an hf uri names one repository, like hf://org/name")
    return ModelUri("hf", name)


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
        mount_path = f"{names.root}/{model.location}"
        return ModelMount(
            path=f"{mount_path}/{model.sub_path}",
            volumes=[
                {
                    "name": names.volume,
                    "persistentVolumeClaim": {"claimName": model.location, "readOnly": True},
                }
            ],
            mounts=[{"name": names.volume, "mountPath": mount_path, "readOnly": True}],
        )
    if model.scheme == "hf" and config.hf_cache_dir:
        return _host_path(posixpath.join(config.hf_cache_dir, model.location), names)
    return _fetched(model, image, names)


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
