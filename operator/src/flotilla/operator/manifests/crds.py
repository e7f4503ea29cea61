"""CustomResourceDefinitions generated from the pydantic models in api.py, and the one CRD the operator
installs but does not define: the Gateway API Inference Extension's InferencePool, as released.

Pydantic emits JSON Schema (2020-12); Kubernetes wants a *structural* OpenAPI v3.0 schema: no $ref,
no `null` types, boolean exclusive bounds, no titles. `openapi_schema` translates one into the other.
`flotilla operator crds` writes the result to crds/, and a test fails when the checked-in files drift.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from flotilla import manifest_yaml
from flotilla.operator.api import inference_extension as gie
from flotilla.operator.api.v1alpha1 import (
    GROUP,
    INFERENCE_SERVICE,
    KINDS,
    LORA_ADAPTER,
    TENANT,
    VERSION,
    Kind,
)

# Kubernetes forbids additionalProperties next to properties; unknown fields are pruned, and
# kubectl's default strict field validation reports them to the user instead.
_DROP_KEYS = {"title"}


def openapi_schema(model: type) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a pydantic model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _convert(raw, defs)


def _convert(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_convert(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _convert(merged, defs)
    node = dict(node)
    any_of = node.get("anyOf")
    if any_of and not node.get("x-kubernetes-int-or-string"):
        non_null = [s for s in any_of if s.get("type") != "null"]
        if len(non_null) == 1 and len(non_null) < len(any_of):
            # Optional[X]: absent on the wire rather than null.
            del node["anyOf"]
            if node.get("default", 0) is None:
                del node["default"]
            return _convert({**non_null[0], **node}, defs)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS or (key == "additionalProperties" and value is False):
            continue
        if key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "properties":
            out[key] = {name: _convert(sub, defs) for name, sub in value.items()}
        elif key == "default" and value is None:
            continue
        else:
            out[key] = _convert(value, defs)
    if out.get("required") == []:
        del out["required"]
    if "enum" in out and "type" not in out:
        out["type"] = _json_type(out["enum"][0])
    if _is_condition_list(out):
        # Conditions are a map keyed by type, so server-side apply merges them per type.
        out["x-kubernetes-list-type"] = "map"
        out["x-kubernetes-list-map-keys"] = ["type"]
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string"


def _is_condition_list(schema: dict[str, Any]) -> bool:
    items = schema.get("items")
    return (
        schema.get("type") == "array"
        and isinstance(items, dict)
        and {"type", "status", "reason"} <= set(items.get("properties", {}))
    )


def _printer_columns(kind: Kind) -> list[dict[str, Any]]:
    age = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    if kind is INFERENCE_SERVICE:
        return [
            {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
            {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
            {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
            {"name": "GPUs", "type": "integer", "jsonPath": ".status.gpus"},
            {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri"},
            {"name": "Reason", "type": "string", "priority": 1, "jsonPath": ".status.message"},
            age,
        ]
    if kind is TENANT:
        return [
            {"name": "Namespaces", "type": "string", "jsonPath": ".spec.namespaces"},
            {"name": "Quota", "type": "string", "jsonPath": ".spec.gpuQuota"},
            {"name": "Allocated", "type": "string", "jsonPath": ".status.gpusAllocated"},
            age,
        ]
    if kind is LORA_ADAPTER:
        return [
            {"name": "Service", "type": "string", "jsonPath": ".spec.inferenceService"},
            {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
            {"name": "Loaded", "type": "integer", "jsonPath": ".status.loadedReplicas"},
            {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
            {"name": "Source", "type": "string", "priority": 1, "jsonPath": ".spec.source"},
            age,
        ]
    raise ValueError(kind.kind)


def crd(kind: Kind) -> dict[str, Any]:
    """The CustomResourceDefinition for one kind."""
    schema = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(kind.spec),
            "status": openapi_schema(kind.status),
        },
    }
    subresources: dict[str, Any] = {"status": {}}
    if kind is INFERENCE_SERVICE:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": kind.crd_name},
        "spec": {
            "group": GROUP,
            "scope": kind.scope,
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.singular,
                "shortNames": kind.short_names,
                "categories": ["flotilla"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": subresources,
                    "additionalPrinterColumns": _printer_columns(kind),
                }
            ],
        },
    }


HEADER = "# Generated from operator/api.py by `flotilla operator crds`. Do not edit by hand.\n"


def render(kind: Kind) -> str:
    return HEADER + manifest_yaml.dump(crd(kind), sort_keys=False, width=110)


PEERING_CRD_NAME = "clusterkopfpeerings.kopf.dev"


def kopf_peering_crd() -> dict[str, Any]:
    """kopf's ClusterKopfPeering: the object through which operator replicas see each other, so that
    only one acts (kopf's peering). Its status is kopf's own, free-form."""
    schema = {
        "type": "object",
        "properties": {
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": PEERING_CRD_NAME},
        "spec": {
            "group": "kopf.dev",
            "scope": "Cluster",
            "names": {
                "kind": "ClusterKopfPeering",
                "plural": "clusterkopfpeerings",
                "singular": "clusterkopfpeering",
            },
            "versions": [
                {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": schema}}
            ],
        },
    }


# The InferencePool CRD (inference.networking.k8s.io/v1) of the Gateway API Inference Extension, pinned to
# one release and installed byte for byte as released: the standard's schema, not ours to generate. Kept in
# the package (manifests/gie/, with a README naming the same source), so an installed operator needs no
# checkout. A new release: copy its file over, change these four lines, run `flotilla operator crds` and
# `chart`; tests/operator/test_crds.py pins the file's digest.
GIE_VERSION = "v1.6.0"
GIE_REPOSITORY = "https://github.com/kubernetes-sigs/gateway-api-inference-extension"
GIE_COMMIT = "992e5c292afb248801ce8d9234eb5b9d28eea231"  # what the tag v1.6.0 points to
GIE_PATH = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
GIE_FILE = "gie/inference.networking.k8s.io_inferencepools.yaml"  # in this package
GIE_HEADER = (
    f"# The Gateway API Inference Extension's InferencePool CRD ({gie.API_VERSION}), release {GIE_VERSION},\n"
    f"# as released: {GIE_REPOSITORY}/blob/{GIE_VERSION}/{GIE_PATH}\n"
    f"# (commit {GIE_COMMIT}). Copyright The Kubernetes Authors, Apache License 2.0.\n"
    "# Its schema is unchanged: `flotilla operator crds` and `chart` copy operator/src/flotilla/operator/\n"
    "# manifests/gie/ (the chart adds only its keep annotation).\n"
)


def inference_pool_crd_text() -> str:
    """The InferencePool CRD exactly as the pinned release ships it."""
    return resources.files(__package__).joinpath(GIE_FILE).read_text(encoding="utf-8")


def inference_pool_crd() -> dict[str, Any]:
    return yaml.safe_load(inference_pool_crd_text())


def crd_files() -> dict[str, str]:
    """File name -> YAML text, for every kind, kopf's peering CRD and the InferencePool's."""
    files = {f"{kind.crd_name}.yaml": render(kind) for kind in KINDS}
    files[f"{PEERING_CRD_NAME}.yaml"] = HEADER + manifest_yaml.dump(
        kopf_peering_crd(), sort_keys=False, width=110
    )
    files[f"{gie.CRD_NAME}.yaml"] = GIE_HEADER + inference_pool_crd_text()
    return files


def write_crds(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in crd_files().items():
        path = directory / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        written.append(path)
    return written
