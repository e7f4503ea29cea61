"""Semantic validation: specs that are well-formed (the CRD schema passed them) but wrong in meaning.

Pure: what the rules need from the world (the GPU types the nodes offer, whether a path exists) and from
the operator's settings (the host-path roots the platform allows) is passed in. Each problem names the
field, what is wrong and what would be right. `check` is the one entry point: the reconciler's Valid
condition and the admission webhook's refusals both come from it, worded by `describe`, so a person reads
the same message in either place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from flotilla.contract import ENGINE_KNOBS
from flotilla.operator.api.v1alpha1 import EngineSettings, InferenceServiceSpec
from flotilla.operator.desired import host_paths
from flotilla.operator.desired.model_source import ModelUriError, parse_model_uri
from flotilla.operator.naming import GPU_TYPE_LABEL
from flotilla.quantity import quantity_bytes


@dataclass(frozen=True)
class Problem:
    field: str
    message: str
    reason: str  # CamelCase, for the Valid condition and the Event

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def parse_spec(raw: dict) -> tuple[InferenceServiceSpec | None, list[Problem]]:
    """The typed spec, or the schema problems when the object bypassed the CRD schema (or it changed)."""
    try:
        return InferenceServiceSpec.model_validate(raw), []
    except ValidationError as exc:
        problems = [
            Problem("spec." + ".".join(str(p) for p in err["loc"]), _schema_message(err), "InvalidSpec")
            for err in exc.errors()
        ]
        return None, problems


def _schema_message(err: ErrorDetails) -> str:
    """pydantic's message, with the refused value when it is a plain one (not a whole object)."""
    value = err.get("input")
    if err["type"] == "missing" or not isinstance(value, str | int | float | bool):
        return err["msg"]
    return f"{err['msg']}, got {value!r}"


def check(
    raw: dict,
    *,
    gpu_types: Iterable[str] | None = None,
    path_exists: Callable[[str], bool] | None = None,
    host_path_roots: Sequence[str] | None = None,
) -> tuple[InferenceServiceSpec | None, list[Problem]]:
    """The typed spec (None when it does not parse) and every problem with it."""
    spec, problems = parse_spec(raw)
    if spec is None:
        return None, problems
    return spec, validate(spec, gpu_types=gpu_types, path_exists=path_exists, host_path_roots=host_path_roots)


def describe(problems: Iterable[Problem]) -> str:
    """What a person is told about an invalid spec (the Valid condition's message, the webhook's refusal)."""
    return "; ".join(str(p) for p in problems)


def validate(
    spec: InferenceServiceSpec,
    *,
    gpu_types: Iterable[str] | None,
    path_exists: Callable[[str], bool] | None,
    host_path_roots: Sequence[str] | None = None,
) -> list[Problem]:
    """Problems with a parsed spec. The world's rules are skipped when their input is None: `gpu_types`
    when the nodes are not known here, `path_exists` when file paths cannot be checked from here. So is
    the host-path rule when `host_path_roots` is None (a caller that mounts nothing); the two that do, the
    reconciler and the webhook, pass OperatorConfig.host_path_roots, where empty allows no host path."""
    problems: list[Problem] = []
    auto = spec.autoscaling
    if auto is not None and auto.min_replicas > auto.max_replicas:
        problems.append(
            Problem(
                "spec.autoscaling",
                f"minReplicas ({auto.min_replicas}) is greater than maxReplicas ({auto.max_replicas})",
                "InvalidReplicaRange",
            )
        )
    problems += _model_uri_problems("spec.model.uri", spec.model.uri, path_exists, host_path_roots)
    if spec.engine.kv_cache_memory is not None:
        try:
            quantity_bytes(spec.engine.kv_cache_memory)
        except ValueError as exc:
            problems.append(Problem("spec.engine.kvCacheMemory", str(exc), "InvalidQuantity"))
    problems += _engine_problems(spec.engine, path_exists, host_path_roots)
    gpu_type = spec.resources.gpu_type
    known = sorted(set(gpu_types or ()))
    if gpu_types is not None and gpu_type is not None and gpu_type not in known:
        offered = ", ".join(known) if known else "none"
        problems.append(
            Problem(
                "spec.resources.gpuType",
                f"no node has GPU type {gpu_type!r} (node label {GPU_TYPE_LABEL}); types on nodes: {offered}",
                "UnknownGPUType",
            )
        )
    return problems


def _model_uri_problems(
    field: str,
    uri: str,
    path_exists: Callable[[str], bool] | None,
    host_path_roots: Sequence[str] | None,
) -> list[Problem]:
    """A model uri we cannot mount, a file:// path outside the allowed roots, or one the nodes do not have."""
    try:
        model = parse_model_uri(uri)
    except ModelUriError as exc:
        return [Problem(field, str(exc), "InvalidModelUri")]
    if model.scheme == "file" and host_path_roots is not None:
        refusal = host_path_problem(
            field, uri, model.location, host_path_roots, "a pvc://claim/path or hf://org/name uri"
        )
        if refusal is not None:
            # No existence check: whether a folder outside the roots exists is none of the tenant's business.
            return [refusal]
    if model.scheme == "file" and path_exists is not None and not path_exists(model.location):
        return [Problem(field, f"model path {model.location} does not exist on the nodes", "ModelNotFound")]
    return []


def host_path_problem(
    field: str, value: str, path: str, roots: Sequence[str], otherwise: str
) -> Problem | None:
    """The refusal of a host path a tenant named (`value` as written, `path` as it would be mounted) outside
    the roots the platform allows (host_paths.allowed, the one rule), naming the field, the value and the
    roots; `otherwise` is what the tenant may use instead. None when it is allowed."""
    if host_paths.allowed(path, roots):
        return None
    where = "" if value == path else f" (host path {path})"
    if roots:
        why = f"under none of the host-path roots the operator allows ({', '.join(roots)})"
        instead = f"name a folder under one of them, or use {otherwise}"
    else:
        why = "the operator allows no host paths (no --host-path-root is set)"
        instead = f"use {otherwise}, or ask the platform team to allow a root"
    return Problem(field, f"{value!r}{where}: {why}; {instead}", "HostPathNotAllowed")


def _engine_problems(
    engine: EngineSettings,
    path_exists: Callable[[str], bool] | None,
    host_path_roots: Sequence[str] | None,
) -> list[Problem]:
    """The engine settings that are each valid but not together."""
    problems: list[Problem] = []
    if engine.quantization_group_size is not None and engine.quantization != "int4":
        quantization = "unset" if engine.quantization is None else repr(engine.quantization)
        problems.append(
            Problem(
                "spec.engine.quantizationGroupSize",
                f"{engine.quantization_group_size} is set while quantization is {quantization}; a group "
                "size applies to int4 only (set quantization: int4, or leave quantizationGroupSize out)",
                "InvalidQuantization",
            )
        )
    problems += _lora_problems(engine, path_exists, host_path_roots)
    speculative = engine.speculative
    if speculative is None:
        return problems
    field = "spec.engine.speculative.model"
    if speculative.method == "draft" and speculative.model is None:
        problems.append(
            Problem(
                field,
                "method 'draft' needs a draft model: set model.uri to a smaller model with the same "
                "tokenizer (or use method: ngram, which needs none)",
                "InvalidSpeculative",
            )
        )
    elif speculative.method == "ngram" and speculative.model is not None:
        problems.append(
            Problem(
                field,
                f"method 'ngram' takes no draft model, got uri {speculative.model.uri!r} (use method: draft "
                "to speculate with it, or leave model out)",
                "InvalidSpeculative",
            )
        )
    elif speculative.model is not None:
        problems += _model_uri_problems(f"{field}.uri", speculative.model.uri, path_exists, host_path_roots)
    return problems


# The engine's defaults for the LoRA sizes (flotilla.contract.ENGINE_KNOBS), for the rule between two of them.
_DEFAULT_MAX_LORAS = ENGINE_KNOBS["max_loras"].default
_DEFAULT_MAX_CPU_LORAS = ENGINE_KNOBS["max_cpu_loras"].default


def _lora_problems(
    engine: EngineSettings,
    path_exists: Callable[[str], bool] | None,
    host_path_roots: Sequence[str] | None,
) -> list[Problem]:
    """spec.engine.lora's rules across fields: the engine's own (EngineConfig refuses them at start), worded
    here so that the webhook refuses them before a pod crashes on them."""
    lora = engine.lora
    if lora is None:
        return []
    problems: list[Problem] = []
    sizes = {
        "maxLoras": lora.max_loras,
        "maxLoraRank": lora.max_lora_rank,
        "maxCpuLoras": lora.max_cpu_loras,
        "adapterDir": lora.adapter_dir,
        "adapterClaim": lora.adapter_claim,
    }
    sized = [name for name, value in sizes.items() if value is not None]
    if not lora.enabled:
        if sized:
            problems.append(
                Problem(
                    "spec.engine.lora.enabled",
                    f"{', '.join(sized)} set while enabled is {'false' if lora.enabled is False else 'unset'}; "
                    "set enabled: true to serve adapters, or leave the sizes out",
                    "InvalidLoRA",
                )
            )
        return problems
    if engine.quantization not in (None, "none"):
        problems.append(
            Problem(
                "spec.engine.lora.enabled",
                f"true with quantization {engine.quantization!r}: LoRA adapters are served over an unquantized "
                "base only (set quantization: none, or leave lora out)",
                "InvalidLoRA",
            )
        )
    max_loras = lora.max_loras if lora.max_loras is not None else _DEFAULT_MAX_LORAS
    max_cpu = lora.max_cpu_loras if lora.max_cpu_loras is not None else _DEFAULT_MAX_CPU_LORAS
    if max_cpu < max_loras:
        problems.append(
            Problem(
                "spec.engine.lora.maxCpuLoras",
                f"{max_cpu} is below maxLoras ({max_loras}): an adapter in a device slot is also kept in host "
                "memory, so maxCpuLoras must be at least maxLoras",
                "InvalidLoRA",
            )
        )
    if not lora.adapter_dir:
        return problems
    # Checked as workload.lora_adapter_mount mounts it (normalized); outside the roots, not probed.
    mounted = host_paths.normalize(lora.adapter_dir)
    refusal = None
    if host_path_roots is not None:
        refusal = host_path_problem(
            "spec.engine.lora.adapterDir",
            lora.adapter_dir,
            mounted,
            host_path_roots,
            "adapterClaim (a PersistentVolumeClaim)",
        )
    if refusal is not None:
        problems.append(refusal)
    elif path_exists is not None and not path_exists(lora.adapter_dir):
        problems.append(
            Problem(
                "spec.engine.lora.adapterDir",
                f"folder {lora.adapter_dir} does not exist on the nodes (it is mounted into every replica)",
                "AdapterDirNotFound",
            )
        )
    return problems
