"""Drift: does an observed child still hold every field the operator wants? Pure.

The API server adds defaults (protocol, terminationMessagePath, ...) and other controllers add fields,
so the test is containment, not equality: every desired value must be present in the observed object.
Only a real difference triggers a re-apply, which keeps watch events from looping.
"""

from __future__ import annotations

from typing import Any


def contains(observed: Any, desired: Any) -> bool:
    if isinstance(desired, dict):
        return isinstance(observed, dict) and all(
            contains(observed[key], value) if key in observed else _omitted(value)
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        # Lists we write are complete (containers, env, ports): same length, item by item.
        return (
            isinstance(observed, list)
            and len(observed) == len(desired)
            and all(contains(o, d) for o, d in zip(observed, desired, strict=True))
        )
    if isinstance(desired, bool) or isinstance(observed, bool):
        return desired is observed
    if (
        isinstance(desired, int | float)
        and isinstance(observed, str)
        or isinstance(desired, str)
        and isinstance(observed, int)
    ):
        return str(desired) == str(observed)
    return observed == desired


def _omitted(value: Any) -> bool:
    # The API server drops empty strings, lists and maps (omitempty), e.g. an env var whose value is "".
    return value is None or value == "" or value == [] or value == {}


def drifted(observed: dict, desired: dict) -> list[str]:
    """Top-level paths (metadata.labels, spec, ...) where the observed object no longer matches."""
    paths = []
    for section in ("metadata", "spec"):
        want = desired.get(section, {})
        have = observed.get(section) or {}
        for key, value in want.items():
            if key in ("name", "namespace"):
                continue
            if not contains(have, {key: value}):
                paths.append(f"{section}.{key}")
    return paths
