"""One pod's volumes staged on the host, under the pod's own folder in the agent's state dir.

- emptyDir: a folder `<root>/<volume>`, shared by every container of the pod (medium and sizeLimit are
  ignored: it is a plain folder on disk).
- hostPath: the host path itself, checked or created per `type` (unset creates a missing folder, as
  Docker does).
- persistentVolumeClaim: the hostPath or local path of the PersistentVolume the claim is bound to.
- configMap, secret, downwardAPI, projected (serviceAccountToken, configMap, secret, downwardAPI
  sources): files in `<root>/<volume>`, written with the kubelet's atomic writer (atomic_dir) before the
  first container starts and rewritten every REFRESH_SECONDS when a source object changed or a token is
  due for renewal. A file mounted with subPath is bound once at container start, so like on a kubelet
  it keeps the content it had then.

The agent removes `<root>` when the pod is deleted; host paths and claims are never touched.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from flotilla.cluster import atomic_dir
from flotilla.cluster.service_account import with_api_access
from flotilla.cluster.volume_contents import Sources, VolumeError, volume_files

REFRESH_SECONDS = 15.0
PROJECTIONS = ("configMap", "secret", "downwardAPI", "projected")

# (namespace, claim name) -> the host folder of the PersistentVolume the claim is bound to.
ClaimPath = Callable[[str, str], str]


def host_path(source: dict) -> str:
    """Checks or creates a hostPath volume's path per its `type`, as the kubelet does."""
    path, kind = source["path"], source.get("type") or ""
    if kind in ("", "DirectoryOrCreate") and not os.path.exists(path):
        os.makedirs(path, mode=0o755, exist_ok=True)
    elif kind == "FileOrCreate" and not os.path.exists(path):
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        with open(path, "a"):
            pass
    checks = {
        "Directory": os.path.isdir,
        "File": os.path.isfile,
        "Socket": lambda p: os.path.exists(p) and stat.S_ISSOCK(os.stat(p).st_mode),
        "CharDevice": lambda p: os.path.exists(p) and stat.S_ISCHR(os.stat(p).st_mode),
        "BlockDevice": lambda p: os.path.exists(p) and stat.S_ISBLK(os.stat(p).st_mode),
    }
    if kind in checks and not checks[kind](path):
        raise VolumeError(f"hostPath {path} is not a {kind}")
    return path


def mount_plan(container: dict, volume_paths: dict[str, str], read_only: set[str]) -> list[dict]:
    """A container's volumeMounts as {source, target, readOnly} binds for mount_ns (plus the volume's
    name and whether a subPath was used, which PodVolumes.mounts_for takes off again).

    volume_paths maps each volume to its host folder; volumes in read_only are always mounted read-only
    (projections, as the kubelet does, and claims or hostPaths marked readOnly at the volume)."""
    mounts = []
    for mount in container.get("volumeMounts") or []:
        name = mount["name"]
        if name not in volume_paths:
            raise VolumeError(f"volumeMount {mount['mountPath']!r} names no volume {name!r} of this pod")
        source = volume_paths[name]
        sub_path = mount.get("subPath") or ""
        if sub_path:
            norm = posixpath.normpath(sub_path)
            if norm.startswith(("/", "..")):
                raise VolumeError(f"subPath {sub_path!r} must be relative and stay inside volume {name!r}")
            source = posixpath.join(source, norm)
        mounts.append(
            {
                "source": source,
                "target": mount["mountPath"],
                "readOnly": bool(mount.get("readOnly")) or name in read_only,
                "subPath": bool(sub_path),
                "volume": name,
            }
        )
    return mounts


class PodVolumes:
    def __init__(
        self,
        pod: dict,
        root: Path,
        sources: Sources,
        service_account: Callable[[], dict | None],
        claim_path: ClaimPath,
    ):
        self.pod = pod
        self.root = root
        self.sources = sources
        self.service_account = service_account
        self.claim_path = claim_path
        self.paths: dict[str, str] = {}
        self.read_only: set[str] = set()
        self.projected: set[str] = set()
        self.prepared = False
        self.next_refresh = 0.0

    def _volumes(self) -> list[dict]:
        return (self.pod.get("spec") or {}).get("volumes") or []

    def prepare(self, now: float) -> None:
        """Stages every volume; raises VolumeError (the containers wait) until all of them can be."""
        if self.prepared:
            return
        # Once, before anything is staged: the pod plus the ServiceAccount volume a kubelet-less
        # admission may have left out (see service_account.with_api_access).
        self.pod = with_api_access(self.pod, self.service_account)
        namespace = self.pod["metadata"]["namespace"]
        for volume in self._volumes():
            name = volume["name"]
            if "emptyDir" in volume:
                folder = self.root / name
                folder.mkdir(parents=True, exist_ok=True)
                self.paths[name] = str(folder)
            elif "hostPath" in volume:
                self.paths[name] = host_path(volume["hostPath"])
            elif "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]
                self.paths[name] = self.claim_path(namespace, claim["claimName"])
                if claim.get("readOnly"):
                    self.read_only.add(name)
            elif any(kind in volume for kind in PROJECTIONS):
                self._project(volume)
                self.paths[name] = str(self.root / name)
                self.read_only.add(name)
                self.projected.add(name)
            else:
                kinds = ", ".join(k for k in volume if k != "name")
                raise VolumeError(f"volume {name!r}: type {kinds} is not supported by the node agent")
        self.prepared = True
        self.next_refresh = now + REFRESH_SECONDS

    def _project(self, volume: dict) -> bool:
        files = volume_files(volume, self.pod, self.sources)
        return atomic_dir.write(self.root / volume["name"], files or {})

    def refresh(self, now: float) -> list[str]:
        """Rewrites projections whose sources changed; returns problems (the old files stay meanwhile)."""
        if not self.prepared or now < self.next_refresh:
            return []
        self.next_refresh = now + REFRESH_SECONDS
        problems = []
        for volume in self._volumes():
            if any(kind in volume for kind in PROJECTIONS):
                try:
                    self._project(volume)
                except Exception as exc:  # VolumeError, OSError or the API failing: try again later
                    problems.append(f"volume {volume['name']!r}: {exc}")
        return problems

    def observe(self, pod: dict) -> None:
        """The latest metadata from the watch (labels, annotations); the spec stays as prepared."""
        self.pod = {**self.pod, "metadata": pod["metadata"]}

    def mounts_for(self, container_name: str) -> list[dict]:
        """The binds for one container (of the prepared pod, so implicit mounts are included)."""
        spec = self.pod.get("spec") or {}
        containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
        container = next((c for c in containers if c["name"] == container_name), {})
        mounts = mount_plan(container, self.paths, self.read_only)
        for mount in mounts:
            volume = mount.pop("volume")
            if not mount.pop("subPath") or os.path.lexists(mount["source"]):
                continue
            # The kubelet creates a missing subPath in a writable volume, never inside a projection.
            if volume in self.projected:
                raise VolumeError(f"subPath {mount['source']} does not exist in volume {volume!r}")
            os.makedirs(mount["source"], exist_ok=True)
        return mounts

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
