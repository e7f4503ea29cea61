"""Reading a Kubernetes object's status conditions: one rule for pods and Flotilla's own kinds alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_ready(obj: Mapping[str, Any]) -> bool:
    """Whether the object's `Ready` condition is `True` (a pod's, an InferenceService's)."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
