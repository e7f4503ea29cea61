"""Which node folders the operator may mount into a pod as hostPath volumes: the one rule.

A tenant names host paths (a file:// model uri, spec.engine.lora.adapterDir) and the operator mounts them,
so a tenant who may not create pods could otherwise have the operator mount /etc/kubernetes or
/var/lib/kubelet. The platform team allows folders (OperatorConfig.host_path_roots, --host-path-root);
a path is allowed when it is one of them or lies under one. The check is lexical, on the path the operator
then mounts (the same normalized string), so `..` and `//` cannot walk out of a root between the check and
the mount; the roots themselves must hold no link a tenant could plant (docs/tenancy.md says so).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable


def normalize(path: str) -> str:
    """`path` as the operator mounts it: posixpath.normpath, and a leading `//` (which normpath keeps,
    POSIX leaving it implementation-defined) as the single `/` Linux reads it as."""
    path = posixpath.normpath(path)
    return "/" + path.lstrip("/") if path.startswith("//") else path


def allowed(path: str, roots: Iterable[str]) -> bool:
    """Whether `path`, normalized, equals one of `roots` or lies under one. A relative path (or a relative
    root) is never allowed: a hostPath is absolute, and a relative one would mean nothing here. Under means
    a whole path component deeper: /data-evil is not under /data."""
    if not path.startswith("/"):
        return False
    path = normalize(path)
    for root in roots:
        if not root.startswith("/"):
            continue
        root = normalize(root)
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return True
    return False
