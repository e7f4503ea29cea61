"""The flotilla.dev/v1alpha1 API: InferenceService and Tenant, as pydantic models.

These models are the one source of truth for the API's shape: crds/*.yaml is generated from them
(`flotilla operator crds`), and the controllers parse objects through them. Python names are snake_case;
the wire format is camelCase (aliases). Constraints written here (enums, minimums, required fields)
become OpenAPI validation in the CRD, so the API server rejects malformed input before we see it.
Rules that need context (other objects, the nodes, the filesystem) live in validation.py instead.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from flotilla.ownership import selector_problems

GROUP = "flotilla.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Kubernetes quantities ("500m", "16Gi", 2): a string or an integer on the wire.
Quantity = Annotated[
    str | int,
    WithJsonSchema({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}),
]
# A DNS-1123 label, the shape of a Kubernetes label value we put on nodes and in selectors.
LABEL_VALUE_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# A PersistentVolumeClaim's name (a DNS-1123 subdomain): spec.engine.lora.adapterClaim, and the claim of a
# pvc:// model uri or LoRAAdapter source (desired/model_source.py).
CLAIM_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
CLAIM_NAME_MAX = 253


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def to_wire(self) -> dict:
        """The camelCase dict as the API server stores it, without unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# ---------------------------------------------------------------------------------------------------
# Conditions, shared by both kinds (the metav1.Condition shape, so kubectl and tools understand it).


class Condition(_Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase, machine-readable")
    message: str = ""
    last_transition_time: str | None = Field(default=None, description="RFC 3339")
    observed_generation: int | None = None


# ---------------------------------------------------------------------------------------------------
# InferenceService


class ModelSource(_Model):
    uri: str = Field(
        min_length=1,
        description="file:///path (a path on the node), pvc://claim/path, or hf://org/name",
    )
    served_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="the model name clients send; defaults to the InferenceService's name",
    )


# spec.engine.speculative.model: where the draft model's files come from (the schemes of spec.model.uri).
class DraftModelSource(_Model):
    uri: str = Field(
        min_length=1,
        description="file:///path (a path on the node), pvc://claim/path, hf://org/name or "
        "https://host/model.tar.gz; a smaller model with the served model's tokenizer",
    )


# spec.engine.speculative: speculative decoding. The methods are flotilla.contract.SPECULATIVE_METHODS less
# "none" (leave speculative out instead), and the token bound is MAX_SPECULATIVE_TOKENS (a test checks).
# Which method takes a model is a cross-field rule: desired/validation.py.
class Speculative(_Model):
    method: Literal["ngram", "draft"] = Field(
        description="ngram (proposals copied from the request's own earlier tokens; no model) or draft (a "
        "smaller model proposes; needs model)",
    )
    num_speculative_tokens: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="tokens proposed per step, all verified in one forward of the served model (the "
        "engine's default 4)",
    )
    max_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="speculate only while at most this many requests run (the engine's default 4); a "
        "fuller batch is compute-bound and gains nothing",
    )
    model: DraftModelSource | None = Field(
        default=None, description="the draft model: required with method draft, refused with ngram"
    )


# spec.engine.lora: LoRA adapters served beside the base model (docs/lora.md). The adapters themselves are
# LoRAAdapter objects, which the operator loads into the replicas at runtime; these size the engine (the
# knobs) and name where the replicas read adapters from: a node folder (adapterDir) and a claim (adapterClaim),
# each a volume: no knob.
# The bounds are the engine's (flotilla.contract's max_loras, max_lora_rank, max_cpu_loras knobs); rules
# across fields (quantization, maxCpuLoras below maxLoras, sizes without enabled) are desired/validation.py's.
class LoRASettings(_Model):
    enabled: bool | None = Field(
        default=None,
        description="serve LoRA adapters (`--enable-lora`): LoRAAdapter objects naming this service are "
        "loaded into its replicas; refused with quantization",
    )
    max_loras: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="adapters active in one batch, each in a device slot (the engine's default 4)",
    )
    max_lora_rank: int | None = Field(
        default=None,
        ge=1,
        le=512,
        description="the highest adapter rank accepted; every slot is sized for it (the engine's default 64)",
    )
    max_cpu_loras: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="adapters loaded in host memory at once, at least maxLoras (the engine's default 16); "
        "loading more fails until one is deleted",
    )
    adapter_dir: str | None = Field(
        default=None,
        min_length=2,
        max_length=4096,
        pattern=r"^/",
        description="a folder on the nodes, mounted read-only into every replica at the same path (hostPath): "
        "the file:// sources of this service's LoRAAdapters must lie under it",
    )
    # Mounted as a pvc:// model's claim is (desired/model_source.claim_mount).
    adapter_claim: str | None = Field(
        default=None,
        min_length=1,
        max_length=CLAIM_NAME_MAX,
        pattern=CLAIM_NAME_PATTERN,
        description="a PersistentVolumeClaim in this service's namespace, mounted read-only into every replica "
        "at /mnt/lora-adapters/<claim>: the pvc://<claim>/<folder> sources of this service's LoRAAdapters must "
        "name it",
    )


# spec.engine: what the operator passes to `flotilla engine serve` (the engine's own settings class is
# flotilla.engine.config.EngineConfig). A comment, not a docstring: a docstring becomes the CRD's description.
class EngineSettings(_Model):
    max_num_seqs: int | None = Field(default=None, ge=1, le=4096, description="sequences in one batch")
    max_num_batched_tokens: int | None = Field(default=None, ge=16, le=1_048_576)
    block_size: Literal[8, 16, 32] | None = Field(default=None, description="tokens per KV block")
    kv_cache_memory: Quantity | None = Field(default=None, description="bytes for the KV pool, e.g. 4Gi")
    prefix_caching: bool | None = None
    dtype: Literal["auto", "float16", "bfloat16", "float32"] | None = None
    # The same names as flotilla.contract.SCHEDULING_POLICIES (a test checks).
    scheduling_policy: Literal["fcfs", "priority", "fair"] | None = Field(
        default=None,
        description="the order requests are admitted and preempted in: fcfs (arrival; the engine's default), "
        "priority (the request's priority, then arrival) or fair (the tenant served least so far first, "
        "weighted by each Tenant's schedulingWeight)",
    )
    # The same values as flotilla.contract.QUANTIZATION_METHODS and QUANTIZATION_GROUP_SIZES (a test checks).
    quantization: Literal["none", "int8", "int4"] | None = Field(
        default=None,
        description="weight-only quantization of the decoder's linear layers at load time: none (the "
        "engine's default), int8 (per output channel) or int4 (per group of input features); embeddings, "
        "norms and the LM head stay in float",
    )
    quantization_group_size: Literal[32, 64, 128] | None = Field(
        default=None,
        description="int4 only (refused with another quantization): input features per scale (the engine's "
        "default 128); must divide every quantized layer's input features, or the engine refuses to start",
    )
    speculative: Speculative | None = Field(
        default=None, description="speculative decoding; unset: none (every token is one forward)"
    )
    lora: LoRASettings | None = Field(
        default=None, description="LoRA adapters (LoRAAdapter objects); unset: none are served"
    )
    extra_args: list[str] = Field(
        default_factory=list, max_length=64, description="appended to `flotilla engine serve`"
    )


class Resources(_Model):
    gpus: int = Field(default=1, ge=0, le=16, description="GPUs per replica (nvidia.com/gpu)")
    gpu_type: str | None = Field(
        default=None,
        max_length=63,
        pattern=LABEL_VALUE_PATTERN,
        description="matched against the node label flotilla.dev/gpu-type",
    )
    cpu: Quantity | None = None
    memory: Quantity | None = None


class Autoscaling(_Model):
    """What the autoscaler (autoscaler.py, rule in autoscale_rule.py) acts on."""

    min_replicas: int = Field(default=1, ge=0, le=1000)
    max_replicas: int = Field(ge=1, le=1000)
    ttft_p95_target_seconds: float | None = Field(default=None, gt=0, le=600)
    queue_depth_target: float | None = Field(
        default=None, gt=0, le=100_000, description="waiting requests per ready replica"
    )
    scale_up_window_seconds: int = Field(default=0, ge=0, le=3600)
    scale_down_window_seconds: int = Field(default=300, ge=0, le=3600)
    period_seconds: int = Field(default=15, ge=1, le=600, description="one scrape and decision per period")
    ttft_window_seconds: int = Field(
        default=60, ge=1, le=3600, description="the TTFT p95 covers requests of this last window"
    )
    tolerance: float = Field(default=0.1, ge=0, le=1, description="ratios within 1 +/- this change nothing")
    scale_to_zero_after_seconds: int = Field(
        default=300,
        ge=30,
        le=86_400,
        description="with minReplicas 0: scale to zero after this long idle (no request running or waiting, "
        "no token served, no demand annotation as recent); a demand annotation older than this is stale",
    )


class InferenceServiceSpec(_Model):
    model: ModelSource
    resources: Resources = Field(default_factory=Resources)
    replicas: int = Field(default=1, ge=0, le=1000, description="the scale subresource's spec.replicas")
    engine: EngineSettings = Field(default_factory=EngineSettings)
    autoscaling: Autoscaling | None = None
    priority: int = Field(default=0, ge=-1000, le=1000, description="higher wins under quota pressure")
    image: str | None = Field(
        default=None, min_length=1, description="engine image; the operator's default if unset"
    )


class AutoscalingMetrics(_Model):
    ttft_p95_seconds: float | None = Field(
        default=None, description="over ttftWindowSeconds; none: no requests"
    )
    queue_depth_per_replica: float | None = Field(default=None, description="waiting requests per ready pod")
    kv_cache_usage_ratio: float | None = Field(default=None, description="the highest of the ready pods")
    ready_pods: int = 0
    pods_scraped: int = 0
    pods_unanswered: int = 0


class AutoscalingStatus(_Model):
    current_metrics: AutoscalingMetrics = Field(default_factory=AutoscalingMetrics)
    recommendation: int | None = Field(default=None, description="before stabilization and limits")
    desired_replicas: int = 0
    last_scale_time: str | None = None
    last_decision_time: str | None = None
    reason: str = ""
    message: str = ""
    conditions: list[Condition] = Field(default_factory=list, description="ScalingActive, QuotaLimited")


class InferenceServiceStatus(_Model):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    replicas: int = Field(default=0, description="pods that exist")
    ready_replicas: int = 0
    desired_replicas: int = Field(default=0, description="what the operator asks the Deployment for")
    gpus: int = Field(default=0, description="GPUs requested by the existing pods")
    selector: str | None = Field(default=None, description="label selector of the pods, for /scale")
    endpoints: list[str] = Field(default_factory=list, description="OpenAI base URLs of ready pods")
    service_url: str | None = None
    message: str = ""
    # Written only by the autoscaler, with its own status patch. Excluded from dumps so the reconciler's
    # merge patch of the whole status never nulls it.
    autoscaling: AutoscalingStatus | None = Field(default=None, exclude=True)


# ---------------------------------------------------------------------------------------------------
# Tenant (cluster-scoped). Defined here; the tenancy issue enforces quotas and meters usage.


class Subject(_Model):
    kind: Literal["User", "Group", "ServiceAccount"]
    name: str = Field(min_length=1)
    namespace: str | None = Field(default=None, description="ServiceAccount subjects only")


class LabelSelectorRequirement(_Model):
    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _values_fit_the_operator(self) -> LabelSelectorRequirement:
        # The rule itself is flotilla.ownership's, so the operator's refusal and the gateway agree.
        problems = selector_problems({"matchExpressions": [self.to_wire()]})
        if problems:
            raise ValueError("; ".join(p.replace("[0]", f" (key {self.key})") for p in problems))
        return self


class LabelSelector(_Model):
    """A Kubernetes LabelSelector; flotilla.ownership decides what it selects (an empty one: nothing)."""

    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)


# spec.rateLimits: what the gateway lets the tenant's API keys send; the operator only stores them.
class RateLimits(_Model):
    requests_per_second: float | None = Field(
        default=None, gt=0, le=1_000_000, description="requests per second, over all the tenant's keys"
    )
    tokens_per_minute: int | None = Field(
        default=None, ge=1, le=10_000_000_000, description="prompt and generated tokens per minute"
    )


class TenantSpec(_Model):
    namespaces: list[str] = Field(default_factory=list)
    namespace_selector: LabelSelector | None = None
    shared: bool = Field(
        default=False,
        description="the platform's shared tenant: the services in its namespaces are open to every tenant's "
        "API key and may be the base of any tenant's LoRAAdapter; their GPUs are charged to this Tenant's "
        "quota and metered to it. A namespace no Tenant claims is shared with nobody",
    )
    gpu_quota: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="GPUs per GPU type"
    )
    max_services: int | None = Field(default=None, ge=0)
    max_lora_adapters: int | None = Field(
        default=None,
        ge=0,
        alias="maxLoRAAdapters",
        description="LoRAAdapter objects the tenant may have in its namespaces (refused at admission past "
        "it); unset: no limit",
    )
    price_per_gpu_hour: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict, alias="pricePerGPUHour"
    )
    monthly_budget: float | None = Field(
        default=None,
        ge=0,
        description="optional spending limit per calendar month (UTC), in pricePerGPUHour's currency; "
        "monitoring alerts when this month's cost is on course to pass it",
    )
    members: list[Subject] = Field(default_factory=list)
    priority: int = Field(default=0, ge=-1000, le=1000)
    scheduling_weight: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="share of a shared engine's service under the fair policy, relative to other tenants",
    )
    rate_limits: RateLimits | None = Field(
        default=None, description="enforced by the gateway, per tenant; unset: no limit"
    )


class GPUSeconds(_Model):
    """GPU-seconds of one window (today, this month, all time), summed along each dimension."""

    total: float = 0.0
    by_namespace: dict[str, float] = Field(default_factory=dict)
    by_service: dict[str, float] = Field(default_factory=dict, description="keyed namespace/name")
    by_gpu_type: dict[str, float] = Field(default_factory=dict)


class TenantUsage(_Model):
    """Views of the ledger (metering.py derives them on every write; the ledger is the source)."""

    today: GPUSeconds = Field(default_factory=GPUSeconds)
    month: GPUSeconds = Field(default_factory=GPUSeconds)
    total: GPUSeconds = Field(default_factory=GPUSeconds)


class TokenCount(_Model):
    input: int = 0
    output: int = 0


class MeteringLedger(_Model):
    """What metering persists to count each GPU-second and token exactly once across restarts."""

    total: dict[str, float] = Field(
        default_factory=dict, description="GPU-seconds keyed namespace/service/gpuType"
    )
    daily: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="UTC date -> GPU-seconds keyed namespace/service/gpuType"
    )
    token_counters: dict[str, TokenCount] = Field(
        default_factory=dict, description="pod uid -> the engine's counters when last read"
    )
    adapter_counters: dict[str, dict[str, TokenCount]] = Field(
        default_factory=dict,
        description="pod uid -> LoRA adapter name -> the engine's per-adapter counters when last read",
    )


class AdapterUsage(_Model):
    """One LoRA adapter's tokens, all time, and their share of the tenant's GPU cost (docs/tenancy.md)."""

    input: int = 0
    output: int = 0
    cost: float = Field(
        default=0.0, description="(input + output) x the tenant's costPerMillionTokens / 1e6, all time"
    )


class TenantStatus(_Model):
    gpus_allocated: dict[str, int] = Field(default_factory=dict, description="GPUs admitted, per type")
    gpu_quota: dict[str, int] = Field(default_factory=dict)
    services: int = Field(default=0, description="InferenceServices in the tenant's namespaces")
    usage: TenantUsage = Field(default_factory=TenantUsage)
    tokens: TokenCount = Field(default_factory=TokenCount, description="served, from the engines' counters")
    cost: float = Field(default=0.0, description="GPU-hours x pricePerGPUHour, all time")
    cost_per_million_tokens: float | None = None
    adapters: dict[str, AdapterUsage] = Field(
        default_factory=dict,
        description="per LoRAAdapter keyed namespace/name, while the adapter exists: tokens served with it "
        "(also counted in tokens) and their cost",
    )
    ledger: MeteringLedger = Field(default_factory=MeteringLedger)
    last_metered_time: str | None = Field(default=None, description="RFC 3339 with microseconds")
    conditions: list[Condition] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# LoRAAdapter (namespaced): a tenant's fine-tune of an InferenceService's base model, which the operator
# loads into every ready replica of that service (docs/lora.md, "In the fleet").

# The source schemes accepted in this version (desired/lora_adapter.py checks the URI).
LORA_SOURCE_SCHEMES = ("file", "pvc", "hf", "http", "https")


class LoRAAdapterSpec(_Model):
    inference_service: str = Field(
        min_length=1,
        max_length=63,
        pattern=LABEL_VALUE_PATTERN,
        description="the base InferenceService, in serviceNamespace; it must set spec.engine.lora.enabled",
    )
    service_namespace: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=LABEL_VALUE_PATTERN,
        description="the base InferenceService's namespace; unset: the adapter's own. Another namespace must be "
        "one the adapter's tenant may use: shared (owned by the platform's shared Tenant) or its own",
    )
    source: str = Field(
        min_length=1,
        max_length=4096,
        description="where the PEFT folder (adapter_config.json, adapter_model.safetensors) is: file:///path, "
        "a folder under the base's spec.engine.lora.adapterDir; pvc://<claim>/<folder>, a folder in the base's "
        "spec.engine.lora.adapterClaim; or hf://org/name[@revision] or "
        "http(s)://.../adapter.tar.gz[#sha256=<hex>], which each replica's engine fetches itself",
    )


class AdapterReplica(_Model):
    """The adapter in one replica (an engine pod of the base service)."""

    pod: str
    phase: Literal["Loading", "Loaded", "Failed"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = Field(default=None, description="RFC 3339")


class LoRAAdapterStatus(_Model):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list, description="Valid, Ready")
    replicas: list[AdapterReplica] = Field(
        default_factory=list, description="one entry per ready replica of the base service"
    )
    loaded_replicas: int = Field(default=0, description="ready replicas that serve the adapter")
    ready_replicas: int = Field(default=0, description="ready replicas of the base service")
    served_name: str | None = Field(default=None, description="the model name requests send: the object's")


# ---------------------------------------------------------------------------------------------------
# Kind metadata: one place for names that CRDs, RBAC and the controllers all need.


class Kind(BaseModel):
    kind: str
    plural: str
    singular: str
    short_names: list[str]
    scope: Literal["Namespaced", "Cluster"]
    spec: type[_Model]
    status: type[_Model]

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"


INFERENCE_SERVICE = Kind(
    kind="InferenceService",
    plural="inferenceservices",
    singular="inferenceservice",
    short_names=["fisvc"],
    scope="Namespaced",
    spec=InferenceServiceSpec,
    status=InferenceServiceStatus,
)
TENANT = Kind(
    kind="Tenant",
    plural="tenants",
    singular="tenant",
    short_names=["ftenant"],
    scope="Cluster",
    spec=TenantSpec,
    status=TenantStatus,
)
LORA_ADAPTER = Kind(
    kind="LoRAAdapter",
    plural="loraadapters",
    singular="loraadapter",
    short_names=["flora"],
    scope="Namespaced",
    spec=LoRAAdapterSpec,
    status=LoRAAdapterStatus,
)
KINDS = [INFERENCE_SERVICE, TENANT, LORA_ADAPTER]
