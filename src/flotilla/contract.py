"""The contract between the engine and the operator: everything one half relies on the other to say.

Both halves import this module and never each other. It holds the engine's port and paths, its metric
and label names (and its latency buckets), the operator's own series names (read by the monitoring rules,
flotilla.monitoring), the environment variables the operator sets on engine pods, the engine's knobs
(ENGINE_KNOBS: each setting of an engine declared once, with its flag, default, parser and the
InferenceService field that sets it) and the functions that build the commands the operator runs in a pod
(`flotilla engine serve ...`, `flotilla model fetch ...`). tests/test_contract.py parses every command the
operator can build with the engine's own CLI parser, so a renamed flag or a missing subcommand fails a test
instead of a pod. Standard library only (and flotilla.quantity, itself standard library only).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from flotilla.quantity import parse_byte_size

# -- where the engine listens -------------------------------------------------------------------------
ENGINE_PORT = 8000
HEALTH_PATH = "/health"  # 200 when serving, 503 while loading or draining
METRICS_PATH = "/metrics"  # Prometheus text format; the operator serves its own metrics on it too
OPENAI_PATH = "/v1"  # the OpenAI-compatible API's base path


def engine_base_url(host: str, port: int = ENGINE_PORT) -> str:
    """The OpenAI base URL of an engine at `host` (what clients and `status.endpoints` use)."""
    return f"http://{host}:{port}{OPENAI_PATH}"


def engine_metrics_url(host: str, port: int = ENGINE_PORT) -> str:
    return f"http://{host}:{port}{METRICS_PATH}"


# -- how Prometheus finds what to scrape: annotations on every pod Flotilla runs ---------------------------
ANNOTATION_SCRAPE = "prometheus.io/scrape"  # "true"
ANNOTATION_PORT = "prometheus.io/port"
ANNOTATION_PATH = "prometheus.io/path"


# -- environment variables the operator sets on engine pods ------------------------------------------------
ENV_POD_IP = "POD_IP"  # the downward API's status.podIP; the engine listens on it
ENV_TENANT = "FLOTILLA_TENANT"  # the Tenant that owns the pod's namespace ("" when none does)
ENV_SERVICE = "FLOTILLA_SERVICE"  # the InferenceService's name
ENV_NAMESPACE = "FLOTILLA_NAMESPACE"
ENV_API_KEY = "FLOTILLA_API_KEY"  # when set, the engine requires 'Authorization: Bearer <key>'
# The operator's credential on the engines of one namespace (engine_token): loading and unloading adapters.
ENV_INTERNAL_TOKEN = "FLOTILLA_INTERNAL_TOKEN"
# The SHA-256 (token_digest) of the gateway's credential (gateway_token): a request naming its tenant in
# HEADER_TENANT must carry the token in HEADER_GATEWAY_TOKEN. Only the digest is in the pod: not a secret.
ENV_GATEWAY_TOKEN_SHA256 = "FLOTILLA_GATEWAY_TOKEN_SHA256"

# -- request headers the engine trusts only from the gateway or the operator -------------------------------
HEADER_TENANT = "X-Flotilla-Tenant"  # the tenant a request is served for (scheduling, metrics)
HEADER_GATEWAY_TOKEN = "X-Flotilla-Gateway-Token"  # Envoy (or the relay) adds it; the picker never sends it
HEADER_INTERNAL_TOKEN = "X-Flotilla-Internal-Token"  # must equal the engine's internal token (the operator's)

# -- the picker's callers: gRPC metadata Envoy sends on ext_proc and EDS (its bootstrap's initial_metadata) --
PICKER_TOKEN_METADATA = "x-flotilla-picker-token"  # picker_token(master): who may ask the picker at all
ENVOY_NODE_METADATA = "x-flotilla-envoy-node"  # the asking Envoy's node id: its picks wait for its EDS ACKs

# -- prefix-cache block hashes: the engine's prefix cache and the gateway's prefix routing -----------------
# Both hash a prompt's full blocks of BLOCK_SIZE token ids the same way, here, so that a block the gateway
# predicts a replica holds is a block that replica's cache can find. A hash is chained: it covers its block
# and, through the parent, every block before it. Python's hash of a tuple of ints is not randomised per
# process (PYTHONHASHSEED salts only str, bytes and datetime), so two processes of the same CPython agree.
ROOT_BLOCK_HASH = 0x5EED  # the parent "hash" of a prompt's first block


def chained_block_hash(parent: int, block_tokens: tuple[int, ...]) -> int:
    return hash((parent, block_tokens))


def root_block_hash(lora_name: str | None = None) -> int:
    """The parent "hash" of a prompt's first block: ROOT_BLOCK_HASH for the base model, and one per LoRA
    adapter, so that KV computed with one adapter's weights is never found by a request for another (or
    for the base). Stable across processes (hash() of a str is salted per process), so the gateway's
    prefix routing and the engine's cache agree."""
    if not lora_name:
        return ROOT_BLOCK_HASH
    digest = hashlib.blake2b(lora_name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # a small int, as hash() of the base chain gives


def prefix_block_hashes(
    token_ids: list[int], block_size: int, known: list[int] | None = None, root: int = ROOT_BLOCK_HASH
) -> list[int]:
    """The chained hashes of every full block of `token_ids`, from `root` (root_block_hash). `known` (the
    hashes of a prefix, computed before) is extended in place and returned, so a growing sequence hashes
    each block once."""
    hashes = [] if known is None else known
    while len(hashes) < len(token_ids) // block_size:
        i = len(hashes)
        parent = hashes[i - 1] if i else root
        hashes.append(chained_block_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
    return hashes


# -- the engine's metrics (Prometheus names; histograms in seconds) ----------------------------------------
# Counters are named without `_total`: prometheus_client appends it in the exposition, so a scraper reads
# `counter_total(NAME)`.
LABEL_MODEL = "model"
LABEL_TENANT = "tenant"
LABEL_SERVICE = "service"
LABEL_FINISH_REASON = "finish_reason"
ENGINE_LABELS = (LABEL_MODEL, LABEL_TENANT, LABEL_SERVICE)

TIME_TO_FIRST_TOKEN = "flotilla_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "flotilla_inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "flotilla_e2e_request_latency_seconds"
NUM_REQUESTS_RUNNING = "flotilla_num_requests_running"
NUM_REQUESTS_WAITING = "flotilla_num_requests_waiting"
KV_CACHE_USAGE_RATIO = "flotilla_kv_cache_usage_ratio"
PREFIX_CACHE_QUERIES = "flotilla_prefix_cache_queries"
PREFIX_CACHE_HITS = "flotilla_prefix_cache_hits"
PROMPT_TOKENS = "flotilla_prompt_tokens"
GENERATION_TOKENS = "flotilla_generation_tokens"
NUM_PREEMPTIONS = "flotilla_num_preemptions"
REQUEST_SUCCESS = "flotilla_request_success"
FINISH_REASONS = ("stop", "length", "abort")
# The latency histograms' bucket boundaries, in seconds: 1 ms to 5 minutes (CPU-only tiny models answer in
# milliseconds, a loaded big model in minutes). The operator's TTFT target series names the largest one at
# or below a service's target, so that the SLO rule can pick that bucket (flotilla.monitoring.rules).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip

# Per request tenant (label LABEL_TENANT is then the request's tenant; at most a bounded number of distinct
# tenants, the rest under OTHER_TENANT).
TENANT_PROMPT_TOKENS = "flotilla_tenant_prompt_tokens"
TENANT_GENERATION_TOKENS = "flotilla_tenant_generation_tokens"
# A gauge in virtual tokens (promtool refuses a metric name that says "counter" for a non-counter).
TENANT_VIRTUAL_TOKEN_COUNTER = "flotilla_tenant_virtual_tokens"
TENANT_NUM_REQUESTS_WAITING = "flotilla_tenant_num_requests_waiting"
TENANT_TIME_TO_FIRST_TOKEN = "flotilla_tenant_time_to_first_token_seconds"
OTHER_TENANT = "other"
# The scheduling policies (`--scheduling-policy`, spec.engine.schedulingPolicy; the engine's core/policy.py).
SCHEDULING_FCFS, SCHEDULING_PRIORITY, SCHEDULING_FAIR = "fcfs", "priority", "fair"
SCHEDULING_POLICIES = (SCHEDULING_FCFS, SCHEDULING_PRIORITY, SCHEDULING_FAIR)

# What the loaded model is: the bytes its weights take (quantized weights and their scales included) and an
# info gauge (always 1) whose labels say the quantization, its int4 group size ("" otherwise) and the dtype
# of the layers that stay in float.
MODEL_WEIGHT_BYTES = "flotilla_model_weight_bytes"
MODEL_INFO = "flotilla_model_info"
LABEL_QUANTIZATION = "quantization"
LABEL_QUANTIZATION_GROUP_SIZE = "quantization_group_size"
LABEL_DTYPE = "dtype"
# Weight-only quantization of the decoder's linear layers (`--quantization`, spec.engine.quantization); the
# int4 group sizes (`--quantization-group-size`, spec.engine.quantizationGroupSize).
QUANTIZATION_METHODS = ("none", "int8", "int4")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
DEFAULT_QUANTIZATION_GROUP_SIZE = 128

# Speculative decoding (`--speculative-method`, spec.engine.speculative.method): none, n-gram prompt lookup
# (no draft model) or a draft model (`--speculative-model`, a smaller model folder with the same tokenizer).
# K (`--num-speculative-tokens`) proposals are verified in one target forward; above
# `--speculative-max-batch-size` running requests a step does not speculate (a full batch is compute-bound).
SPECULATIVE_METHODS = ("none", "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
DEFAULT_SPECULATIVE_MAX_BATCH_SIZE = 4
# vLLM's spec-decode counters: proposals (one per speculating request and step), draft tokens proposed,
# draft tokens accepted, and accepted tokens per draft position (label LABEL_POSITION, 0-based).
SPEC_DECODE_DRAFTS = "flotilla_spec_decode_num_drafts"
SPEC_DECODE_DRAFT_TOKENS = "flotilla_spec_decode_num_draft_tokens"
SPEC_DECODE_ACCEPTED_TOKENS = "flotilla_spec_decode_num_accepted_tokens"
SPEC_DECODE_ACCEPTED_PER_POSITION = "flotilla_spec_decode_num_accepted_tokens_per_pos"
LABEL_POSITION = "position"
# LoRA adapters (`--enable-lora`): vLLM's info gauge (always 1) whose labels name the slots, the adapters
# running and those waiting, comma-separated; and per loaded adapter (label LABEL_LORA_NAME, bounded by
# `--max-cpu-loras`: an unloaded adapter's series go) its finished requests and its tokens.
LORA_REQUESTS_INFO = "flotilla_lora_requests_info"
LABEL_MAX_LORA = "max_lora"
LABEL_RUNNING_LORA_ADAPTERS = "running_lora_adapters"
LABEL_WAITING_LORA_ADAPTERS = "waiting_lora_adapters"
LORA_REQUESTS = "flotilla_lora_requests"
LORA_PROMPT_TOKENS = "flotilla_lora_prompt_tokens"
LORA_GENERATION_TOKENS = "flotilla_lora_generation_tokens"
LABEL_LORA_NAME = "lora_name"


def counter_total(name: str) -> str:
    """The exposed sample name of a counter."""
    return f"{name}_total"


# -- the operator's series (its own /metrics) ----------------------------------------------------------------
# Names only: the operator declares them (flotilla.operator.metrics, tenancy/metering_metrics.py,
# autoscaling/metrics.py) and the monitoring rules read them (flotilla.monitoring.rules). Counters are
# named without `_total`, as above. Labels are bounded: tenants, namespaces, services, GPU types, reasons.
LABEL_NAMESPACE = (
    "namespace"  # the InferenceService's namespace (on engine series: the scrape's target label)
)
LABEL_GPU_TYPE = "gpu_type"
LABEL_REASON = "reason"  # an admission refusal's CamelCase reason (a fixed set)
LABEL_DIRECTION = "direction"  # tokens: "input" | "output"; scales: "up" | "down"
LABEL_TRIGGER = "trigger"  # what started a reconcile (a fixed set)
LABEL_LE = "le"  # a histogram bucket's upper bound, as the engine's exposition spells it

# The reconciler and the webhook.
RECONCILE_DURATION = "flotilla_reconcile_duration_seconds"  # histogram {trigger}
RECONCILE_ERRORS = "flotilla_reconcile_errors"  # counter {trigger}
RECONCILES = "flotilla_reconciles"  # counter {trigger}
OPERATOR_API_CALLS = "flotilla_operator_api_calls"  # counter {verb, resource}
ADMISSION_DENIALS = "flotilla_admission_denials"  # counter {tenant, reason}

# Per InferenceService {namespace, service}, from the status the reconciler writes.
SERVICE_READY = "flotilla_service_ready"  # 1 when the Ready condition is True, else 0
SERVICE_DESIRED_REPLICAS = "flotilla_service_desired_replicas"
SERVICE_READY_REPLICAS = "flotilla_service_ready_replicas"
# spec.autoscaling.ttftP95TargetSeconds, only when set; {namespace, service, le}: `le` is the largest
# LATENCY_BUCKETS boundary at or below the target, spelled as in the engine's TTFT histogram.
SERVICE_TTFT_TARGET = "flotilla_service_ttft_p95_target_seconds"

# The autoscaler {namespace, service}.
AUTOSCALER_DESIRED_REPLICAS = "flotilla_autoscaler_desired_replicas"
AUTOSCALER_TTFT_P95 = "flotilla_autoscaler_ttft_p95_seconds"
AUTOSCALER_QUEUE_DEPTH = "flotilla_autoscaler_queue_depth_per_replica"
AUTOSCALER_KV_CACHE_USAGE = "flotilla_autoscaler_kv_cache_usage_ratio"
AUTOSCALER_SCRAPE_FAILURES = "flotilla_autoscaler_scrape_failures"  # counter
AUTOSCALER_SCALES = "flotilla_autoscaler_scales"  # counter {namespace, service, direction}

# Per Tenant, from what metering last wrote to Tenant.status and from its spec.
TENANT_GPU_SECONDS = "flotilla_tenant_gpu_seconds"  # counter {tenant, namespace, service, gpu_type}
TENANT_GPUS_ALLOCATED = "flotilla_tenant_gpus_allocated"  # {tenant, gpu_type}
TENANT_GPU_QUOTA = "flotilla_tenant_gpu_quota"  # {tenant, gpu_type}
TENANT_PRICE_PER_GPU_HOUR = "flotilla_tenant_price_per_gpu_hour"  # {tenant, gpu_type}: spec.pricePerGPUHour
TENANT_COST = "flotilla_tenant_cost"  # {tenant}: GPU-hours x price, all time
TENANT_MONTH_COST = "flotilla_tenant_month_cost"  # {tenant}: the same, this calendar month (UTC)
TENANT_MONTHLY_BUDGET = "flotilla_tenant_monthly_budget"  # {tenant}: spec.monthlyBudget, only when set
TENANT_METERED_TOKENS = "flotilla_tenant_tokens"  # counter {tenant, direction}
TENANT_LAST_METERED = "flotilla_tenant_last_metered_timestamp_seconds"  # {tenant}: status.lastMeteredTime
# Per LoRAAdapter (status.adapters; bounded by the tenant's LoRAAdapter objects): tokens served with it, and
# their cost at the tenant's cost per million tokens. LABEL_LORA_NAME is the LoRAAdapter's name.
TENANT_ADAPTER_TOKENS = "flotilla_tenant_adapter_tokens"  # counter {tenant, namespace, lora_name, direction}
TENANT_ADAPTER_COST = "flotilla_tenant_adapter_cost"  # {tenant, namespace, lora_name}


# -- the gateway (flotilla.gateway): one OpenAI endpoint in front of every InferenceService ----------------
GATEWAY_PORT = 8080
GATEWAY_SERVICE = "flotilla-gateway"  # its Service's name (the chart's flotilla.gatewayName)
# The gateway as the Gateway API Inference Extension's endpoint picker: every InferencePool the operator
# keeps names, in spec.endpointPickerRef, the Service GATEWAY_SERVICE and this port, where the picker serves
# Envoy's external processing (gRPC; 9002 is the port of GIE's reference picker): `flotilla gateway run
# --picker-port` (flotilla.gateway.extproc; docs/inference-extension.md).
PICKER_PORT = 9002
# The endpoint picker protocol's names (GIE docs/proposals/004-endpoint-picker-protocol): the picked engine
# as `ip:port` in this request header and under this key of the `envoy.lb` dynamic metadata; the data
# plane's optional subset (a list of `ip:port`) under the subset key of the subset-hint filter metadata.
DESTINATION_ENDPOINT_HEADER = "x-gateway-destination-endpoint"
DESTINATION_METADATA_NAMESPACE = "envoy.lb"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
# What the gateway reads of the operator's API (flotilla.operator.api.v1alpha1 uses the same names).
API_GROUP = "flotilla.dev"
API_VERSION = "v1alpha1"
INFERENCE_SERVICES = "inferenceservices"  # plural
TENANTS = "tenants"  # plural, cluster-scoped
LORA_ADAPTERS = "loraadapters"  # plural, namespaced: flotilla.operator.api.v1alpha1.LORA_ADAPTER
POD_SERVICE_LABEL = "flotilla.dev/inferenceservice"  # on every engine pod: its InferenceService's name
# The engine's tokenizer (tokenizer.json, tokenizer_config.json) and KV block size, as JSON: the gateway
# tokenizes prompts as the engine does and hashes them with prefix_block_hashes.
ENGINE_TOKENIZER_PATH = "/flotilla/tokenizer"
# Tenants' API keys: Secrets in the gateway's namespace labelled API_KEY_SECRET_LABEL=<tenant>; every data
# entry (its name is the key's name) is api_key_digest(key). Rotating a key is editing the Secret.
API_KEY_SECRET_LABEL = "flotilla.dev/api-keys-for"
# The internal token engines accept HEADER_TENANT with is per namespace: engine_token(master, namespace).
# The operator writes it into the Secret ENGINE_TOKEN_SECRET (key ENGINE_TOKEN_SECRET_KEY) of each namespace
# that runs engines and sets ENV_INTERNAL_TOKEN from it; the gateway derives it from the same master. Who
# reads one namespace's Secret learns nothing about another namespace's token.
ENGINE_TOKEN_SECRET = "flotilla-engine-token"
ENGINE_TOKEN_SECRET_KEY = "token"
# The gateway's demand signal for a service at zero replicas: it sets this annotation on the
# InferenceService to the RFC 3339 time it held a request; the operator scales such a service to one.
ANNOTATION_DEMAND = "flotilla.dev/demand"


def api_key_digest(key: str) -> str:
    """What a key Secret stores for an API key: its SHA-256, hex (keys are random, so no salt is needed)."""
    return token_digest(key)


def engine_token(master: str, namespace: str) -> str:
    """The internal token of the engines in `namespace` (the operator's, for adapter loads), derived from
    the installation's master token."""
    return hmac.new(master.encode(), namespace.encode(), hashlib.sha256).hexdigest()


# The labels of the two installation-wide tokens: not namespace names (those have no ':'), so neither is
# ever some namespace's engine_token.
_GATEWAY_LABEL, _PICKER_LABEL = b"flotilla:gateway", b"flotilla:picker"


def gateway_token(master: str) -> str:
    """The gateway's credential on every engine (HEADER_GATEWAY_TOKEN): Envoy's route adds it to each
    upstream request, so it never travels through the picker's answers."""
    return hmac.new(master.encode(), _GATEWAY_LABEL, hashlib.sha256).hexdigest()


def picker_token(master: str) -> str:
    """What a data plane presents to the picker (PICKER_TOKEN_METADATA): Envoy's bootstrap sends it."""
    return hmac.new(master.encode(), _PICKER_LABEL, hashlib.sha256).hexdigest()


def token_digest(token: str) -> str:
    """What a verifier holds of a token: its SHA-256, hex (tokens are HMAC outputs, so no salt is needed)."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(given: str | None, digest: str | None) -> bool:
    """Whether `given` is the token whose digest is `digest` (constant time; False without either)."""
    if not given or not digest:
        return False
    return hmac.compare_digest(token_digest(given).encode(), digest.encode())


# The gateway's series (its own /metrics). Counters without `_total`, as above.
LABEL_CODE = "code"  # an HTTP status code
LABEL_LIMIT = "limit"  # a rate limit: "requests" | "tokens"
GATEWAY_REQUESTS = "flotilla_gateway_requests"  # counter {tenant, model, code}
GATEWAY_ROUTING_DECISIONS = "flotilla_gateway_routing_decisions"  # counter {reason}
GATEWAY_PROMPT_TOKENS = "flotilla_gateway_prompt_tokens"  # counter: prompt tokens routed
GATEWAY_PREDICTED_HIT_TOKENS = "flotilla_gateway_predicted_prefix_hit_tokens"  # counter, of those
GATEWAY_UPSTREAM_TTFB = "flotilla_gateway_upstream_time_to_first_byte_seconds"  # histogram {model}
GATEWAY_ADDED_LATENCY = "flotilla_gateway_added_latency_seconds"  # histogram: arrival to upstream send
GATEWAY_HELD_REQUESTS = "flotilla_gateway_held_requests"  # gauge {model}: waiting for a replica
GATEWAY_COLD_START = "flotilla_gateway_cold_start_seconds"  # histogram {model}: held until a replica served
GATEWAY_RATE_LIMITED = "flotilla_gateway_rate_limited"  # counter {tenant, limit}
GATEWAY_RATE_LIMIT_STORE_ERRORS = (
    "flotilla_gateway_rate_limit_store_errors"  # counter: Redis failed, decided locally
)
GATEWAY_RETRIES = "flotilla_gateway_retries"  # counter {model}
# counter {reason}: streams that lost their replica after their first output (ended with an error event)
GATEWAY_STREAM_ERRORS = "flotilla_gateway_stream_errors"
# Envoy's own series (its /stats/prometheus, on the gateway pod's port ENVOY_STATS_PORT_NAME), as Envoy names
# them (with `_total` where Envoy adds it): the ones the dashboards read. tests/gateway/test_envoy_stats.py
# checks each against a real Envoy on the chart's bootstrap. Labels: the connection manager's stat prefix
# (ENVOY_CLIENTS_PREFIX: the clients' listener, not the stats one), the cluster (ENVOY_ENGINES_CLUSTER: the
# engines; `flotilla_picker`: the picker), the response's status class (1..5).
ENVOY_STATS_PORT_NAME = "envoy-stats"
ENVOY_STATS_PATH = "/stats/prometheus"
LABEL_ENVOY_PREFIX = "envoy_http_conn_manager_prefix"
LABEL_ENVOY_CLUSTER = "envoy_cluster_name"
LABEL_ENVOY_CODE_CLASS = "envoy_response_code_class"
ENVOY_CLIENTS_PREFIX = "flotilla"  # flotilla.gateway.proxy.bootstrap.LISTENER_STAT_PREFIX
ENVOY_ENGINES_CLUSTER = "flotilla_engines"  # flotilla.gateway.proxy.bootstrap.ENGINES_CLUSTER
ENVOY_DOWNSTREAM_RQ = "envoy_http_downstream_rq_total"  # counter {prefix}: requests from clients
ENVOY_DOWNSTREAM_RQ_XX = "envoy_http_downstream_rq_xx"  # counter {code class, prefix}: responses to them
ENVOY_DOWNSTREAM_RQ_ACTIVE = "envoy_http_downstream_rq_active"  # gauge {prefix}: requests in flight
ENVOY_UPSTREAM_RQ_RETRY = "envoy_cluster_upstream_rq_retry"  # counter {cluster}: retries (the fallback)
ENVOY_UPSTREAM_CX_CONNECT_FAIL = "envoy_cluster_upstream_cx_connect_fail"  # counter {cluster}
ENVOY_MEMBERSHIP_TOTAL = "envoy_cluster_membership_total"  # gauge {cluster}: endpoints Envoy knows (EDS)
ENVOY_EXT_PROC_STREAMS_FAILED = (
    "envoy_http_ext_proc_streams_failed"  # counter {prefix}: picker streams failed
)
ENVOY_EXT_PROC_MESSAGE_TIMEOUTS = "envoy_http_ext_proc_message_timeouts"  # counter {prefix}
ENVOY_SERIES = frozenset({
    ENVOY_DOWNSTREAM_RQ, ENVOY_DOWNSTREAM_RQ_XX, ENVOY_DOWNSTREAM_RQ_ACTIVE, ENVOY_UPSTREAM_RQ_RETRY,
    ENVOY_UPSTREAM_CX_CONNECT_FAIL, ENVOY_MEMBERSHIP_TOTAL, ENVOY_EXT_PROC_STREAMS_FAILED,
    ENVOY_EXT_PROC_MESSAGE_TIMEOUTS,
})  # fmt: skip


# -- conditions the gateway reads (an InferenceService's status.conditions, as the operator writes them) -----
# A service the tenant's GPU quota holds back (at zero replicas, a demand the quota cannot admit) has
# CONDITION_QUOTA_ADMITTED "False" with the quota's message, and CONDITION_DEGRADED "True" with reason
# REASON_QUOTA_LIMITED and the same message; the gateway relays that message to the client it holds.
CONDITION_QUOTA_ADMITTED = "QuotaAdmitted"
CONDITION_DEGRADED = "Degraded"
REASON_QUOTA_LIMITED = "QuotaLimited"


# -- GPUs on nodes: the resource engine pods request and the label that says a node's GPU type ----------------------
# The local cluster's nodes (the node agent's and the kubelet nodes' device plugin) advertise these; the
# operator schedules on them.
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TYPE_LABEL = "flotilla.dev/gpu-type"


# -- the images (the Dockerfile's targets `engine`, `operator` and `gateway`; tests/test_images.py checks them) ----------
# One repository per target, named after the distribution it adds to `flotilla`; tagged with the
# distributions' version. The operator's default engine image and the Helm chart's values read these.
IMAGE_REGISTRY = "ghcr.io/flotilla-dev"
ENGINE_IMAGE_REPOSITORY = f"{IMAGE_REGISTRY}/flotilla-engine"
OPERATOR_IMAGE_REPOSITORY = f"{IMAGE_REGISTRY}/flotilla-operator"
GATEWAY_IMAGE_REPOSITORY = f"{IMAGE_REGISTRY}/flotilla-gateway"
IMAGE_TAG = "0.1.0"
ENGINE_IMAGE = f"{ENGINE_IMAGE_REPOSITORY}:{IMAGE_TAG}"
OPERATOR_IMAGE = f"{OPERATOR_IMAGE_REPOSITORY}:{IMAGE_TAG}"
GATEWAY_IMAGE = f"{GATEWAY_IMAGE_REPOSITORY}:{IMAGE_TAG}"
# The user and group both images run as, and engine pods' runAsUser, runAsGroup and fsGroup.
IMAGE_UID = 65532

# -- the commands the operator runs in engine pods -----------------------------------------------------------
CLI = "flotilla"
ENGINE_SERVE = (CLI, "engine", "serve")
MODEL_FETCH = (CLI, "model", "fetch")

# `flotilla engine serve` flags that are not engine knobs (the server's, and the operator's drain timing).
FLAG_HOST = "--host"
FLAG_PORT = "--port"
FLAG_SERVED_MODEL_NAME = "--served-model-name"
FLAG_SHUTDOWN_DELAY = "--shutdown-delay"
FLAG_DRAIN_TIMEOUT = "--drain-timeout"
FLAG_FETCH_DEST = "--dest"


# -- the engine's knobs: each one declared once, here ---------------------------------------------------------
# A knob is one setting of an engine process. Its entry in ENGINE_KNOBS is where it is spelled: the engine's
# EngineConfig field (flotilla.engine.config takes its defaults from here), its `flotilla engine serve` flag
# with help, default, value parser and choices (flotilla.engine.engine_args declares the flags and builds the
# EngineConfig from here, for the server and the benchmarks alike), and, for a knob the operator sets, where
# its value comes from: the InferenceService field under spec.engine (the operator's desired/workload.py
# reads it by this path) or the Tenants. EngineArgs.flags() writes the operator's argv from the same entries.
# tests/test_engine_knobs.py fails when EngineConfig, the engine's parser, the CRD or the operator's argv
# disagree with the table.


def format_tenant_weights(weights: Iterable[tuple[str, float]] | Mapping[str, float]) -> str:
    """`a=2,b=0.5`, sorted by tenant so the same weights always give the same argv."""
    pairs = sorted(weights.items() if isinstance(weights, Mapping) else weights)
    return ",".join(f"{tenant}={weight:g}" for tenant, weight in pairs)


def parse_tenant_weights(text: str) -> dict[str, float]:
    """The inverse of format_tenant_weights; a ValueError names the bad entry."""
    weights: dict[str, float] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        tenant, sep, value = entry.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not sep or not tenant or not weight > 0:
            raise ValueError(f"{entry!r} is not tenant=weight with a positive weight (example: team-a=2)")
        weights[tenant] = weight
    return weights


def parse_whole_number(text: str, minimum: int, rule: str) -> int:
    """A whole number of at least `minimum`; a ValueError says `rule` (what it must be)."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise ValueError(f"must be {rule}, got {value}")
    return value


def parse_thread_count(text: str) -> int:
    """A thread count: 0 (the default count) or more."""
    return parse_whole_number(text, 0, "0 (the default count) or more")


def parse_positive_count(text: str) -> int:
    """A count of at least 1."""
    return parse_whole_number(text, 1, "1 or more")


def parse_positive_counts(text: str) -> list[int]:
    """Comma-separated counts of at least 1, e.g. 1,32."""
    try:
        return [parse_positive_count(part) for part in text.split(",")]
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None


def parse_lora_modules(text: str) -> dict[str, str]:
    """`name=path,name=path` -> {name: path}; a ValueError names the bad entry."""
    modules: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{entry!r} is not name=path (example: sql-lora=/adapters/sql)")
        if name in modules:
            raise ValueError(f"{name!r} is named twice")
        modules[name] = path
    return modules


def format_lora_modules(modules: Mapping[str, str]) -> str:
    return ",".join(f"{name}={path}" for name, path in sorted(modules.items()))


# How the operator turns a knob's InferenceService field into the knob's value.
CRD_VALUE = "value"  # the field's value is the knob's
CRD_QUANTITY = "quantity"  # a Kubernetes quantity, in bytes (flotilla.quantity.quantity_bytes)
CRD_MODEL = "model"  # a model source the operator mounts in the pod: the knob's value is where

# The attention implementations (`--attention-backend`). auto: triton on CUDA; on the CPU, cpu (the compiled
# decode kernel) for float32 when it builds, else torch.
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(frozen=True)
class Knob:
    """One engine setting. `name` is EngineConfig's field and EngineArgs' keyword; `flag` is its `flotilla
    engine serve` flag, whose value `parse` reads (text -> value; a ValueError says what is wrong), or, for a
    switch (`parse` None), which takes no value and sets the knob to `switch`. `choices` are every value it
    takes: the engine's parser refuses others, or, where `parser_checks` is False, EngineConfig does, naming
    the flag, the value and the rule. `help` may say {default} and name another knob's flag as {its_name}.
    `show` writes a value as the flag's argument. A `required` knob has no default.

    Where the operator sets it: `crd` is the InferenceService field under spec.engine (camelCase, dotted into
    nested objects) and `crd_value` (CRD_*) how that field becomes the value; `from_tenants` knobs come from
    the Tenants instead (their schedulingWeight). EngineArgs carries exactly these (`operator_sets`)."""

    name: str
    flag: str
    help: str
    default: Any = None
    parse: Callable[[str], Any] | None = str
    switch: Any = None
    choices: tuple[Any, ...] = ()
    parser_checks: bool = True
    metavar: str | None = None
    show: Callable[[Any], str] = str
    required: bool = False
    crd: str | None = None
    crd_value: str = CRD_VALUE
    from_tenants: bool = False

    @property
    def dest(self) -> str:
        """The attribute argparse gives the flag's value (`--no-prefix-caching`: no_prefix_caching)."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def operator_sets(self) -> bool:
        return self.crd is not None or self.from_tenants

    def fresh_default(self) -> Any:
        """The default; a mapping as a new dict (no two configs or parsers share one)."""
        return dict(self.default) if isinstance(self.default, Mapping) else self.default

    def argv(self, value: Any) -> list[str]:
        """The flag for `value` (a switch: only when the value is the one it sets)."""
        if self.parse is None:
            return [self.flag] if value == self.switch else []
        return [self.flag, self.show(value)]


def _declare(*knobs: Knob) -> dict[str, Knob]:
    flags = {knob.name: knob.flag for knob in knobs}
    return {k.name: replace(k, help=k.help.format(default=k.default, **flags)) for k in knobs}


# In the order the operator writes their flags (another order would roll every engine's pods).
ENGINE_KNOBS: dict[str, Knob] = _declare(
    Knob(name="model", flag="--model", help="a local Hugging Face model folder", required=True),
    Knob(
        name="max_num_seqs",
        flag="--max-num-seqs",
        help="most requests in one batch",
        default=256,
        parse=int,
        crd="maxNumSeqs",
    ),
    Knob(
        name="max_num_batched_tokens",
        flag="--max-num-batched-tokens",
        help="token budget of one step (prefill chunks included)",
        default=2048,
        parse=int,
        crd="maxNumBatchedTokens",
    ),
    Knob(
        name="block_size",
        flag="--block-size",
        help="tokens per KV block",
        default=16,
        parse=int,
        crd="blockSize",
    ),
    Knob(
        name="max_model_len",
        flag="--max-model-len",
        help="context length (default: the model's)",
        parse=int,
    ),
    Knob(
        name="kv_cache_memory",
        flag="--kv-cache-memory",
        help="bytes for the KV cache, e.g. 2GiB (default: 1 GiB on CPU, {gpu_memory_utilization} of free "
        "memory on CUDA)",
        parse=parse_byte_size,
        crd="kvCacheMemory",
        crd_value=CRD_QUANTITY,
    ),
    Knob(
        name="gpu_memory_utilization",
        flag="--gpu-memory-utilization",
        help="on CUDA without {kv_cache_memory}: the fraction of free GPU memory the KV cache takes "
        "(default {default})",
        default=0.9,
        parse=float,
    ),
    Knob(
        name="enable_prefix_caching",
        flag="--no-prefix-caching",
        help="turn off prefix caching of KV blocks",
        default=True,
        parse=None,
        switch=False,
        crd="prefixCaching",
    ),
    Knob(
        name="dtype", flag="--dtype", help="auto, bfloat16, float16 or float32", default="auto", crd="dtype"
    ),
    Knob(name="device", flag="--device", help="auto, cpu or cuda[:N]", default="auto"),
    Knob(
        name="attention_backend",
        flag="--attention-backend",
        help="auto: triton on CUDA; on the CPU, cpu (a decode kernel compiled on first use) for float32 "
        "where a C compiler is found, else torch",
        default="auto",
        choices=ATTENTION_BACKENDS,
    ),
    Knob(
        name="enforce_eager",
        flag="--enforce-eager",
        help="no CUDA graphs: run every decode step kernel by kernel (graphs are CUDA-only)",
        default=False,
        parse=None,
        switch=True,
    ),
    Knob(
        name="cuda_graph_sizes",
        flag="--cuda-graph-sizes",
        help="decode batch sizes to capture as CUDA graphs, e.g. 1,2,4,8,16 (default: 1, 2, 4, 8, then "
        "every 16 up to 256 or {max_num_seqs}); a larger batch runs without a graph",
        parse=parse_positive_counts,
    ),
    Knob(
        name="scheduling_policy",
        flag="--scheduling-policy",
        help="the order requests are admitted and preempted in: fcfs (arrival), priority (the request's "
        "priority, then arrival) or fair (the tenant served least so far, weighted by {tenant_weights}; the "
        "virtual token counter) (default {default})",
        default=SCHEDULING_FCFS,
        choices=SCHEDULING_POLICIES,
        crd="schedulingPolicy",
    ),
    Knob(
        name="tenant_weights",
        flag="--tenant-weights",
        help="fair-share weights, e.g. team-a=2,team-b=1: a tenant of weight 2 gets twice the tokens of one "
        "of weight 1 when both wait (default: every tenant weighs 1)",
        default=MappingProxyType({}),
        parse=parse_tenant_weights,
        metavar="TENANT=WEIGHT,...",
        show=format_tenant_weights,
        from_tenants=True,
    ),
    Knob(
        name="quantization",
        flag="--quantization",
        help="weight-only quantization of the decoder's linear layers at load time, from the float "
        "checkpoint: int8 (per output channel) or int4 (per group of input features); embeddings, norms and "
        "the LM head stay in float (default {default})",
        default="none",
        choices=QUANTIZATION_METHODS,
        crd="quantization",
    ),
    Knob(
        name="quantization_group_size",
        flag="--quantization-group-size",
        help="int4: input features per scale; must divide every quantized layer's input features (default "
        "{default})",
        default=DEFAULT_QUANTIZATION_GROUP_SIZE,
        parse=int,
        choices=QUANTIZATION_GROUP_SIZES,
        crd="quantizationGroupSize",
    ),
    Knob(
        name="speculative_method",
        flag="--speculative-method",
        help="speculative decoding: ngram (drafts looked up in the request's own tokens) or draft (a smaller "
        "model, {speculative_model}); the output distribution stays the model's. Requests with logprobs or "
        "penalties decode without it (default {default})",
        default="none",
        choices=SPECULATIVE_METHODS,
        parser_checks=False,
        crd="speculative.method",
    ),
    Knob(
        name="num_speculative_tokens",
        flag="--num-speculative-tokens",
        help=f"drafts verified per step, 1 to {MAX_SPECULATIVE_TOKENS} (default {{default}})",
        default=DEFAULT_NUM_SPECULATIVE_TOKENS,
        parse=int,
        crd="speculative.numSpeculativeTokens",
    ),
    Knob(
        name="speculative_model",
        flag="--speculative-model",
        help="the draft model's folder: same tokenizer and vocabulary as {model}",
        crd="speculative.model",
        crd_value=CRD_MODEL,
    ),
    Knob(
        name="speculative_max_batch_size",
        flag="--speculative-max-batch-size",
        help="speculate only in steps that run at most this many requests: a full batch is compute-bound, and "
        "verifying drafts there costs more than it saves (default {default})",
        default=DEFAULT_SPECULATIVE_MAX_BATCH_SIZE,
        parse=int,
        crd="speculative.maxBatchSize",
    ),
    Knob(
        name="seed",
        flag="--seed",
        help="torch's random seed, set at load: the draws of requests without a seed of their own (default "
        "{default})",
        default=0,
        parse=int,
    ),
    Knob(
        name="cpu_threads",
        flag="--threads",
        help="torch CPU threads (0: all cores but one when serving, torch's default otherwise)",
        default=0,
        parse=parse_thread_count,
    ),
    Knob(
        name="enable_lora",
        flag="--enable-lora",
        help="serve LoRA adapters (PEFT folders) beside the base model, mixed in one batch: {lora_modules} "
        "at start, POST /v1/load_lora_adapter and /v1/unload_lora_adapter at runtime",
        default=False,
        parse=None,
        switch=True,
        crd="lora.enabled",
    ),
    Knob(
        name="lora_modules",
        flag="--lora-modules",
        help="adapters to load at start, name=path,... (implies {enable_lora}); a request picks one by "
        "`model: name`",
        default=MappingProxyType({}),
        parse=parse_lora_modules,
        metavar="NAME=PATH,...",
        show=format_lora_modules,
    ),
    Knob(
        name="max_loras",
        flag="--max-loras",
        help="adapters active in one batch (their weights in device slots); a request whose adapter has no "
        "slot waits for one (default {default})",
        default=4,
        parse=parse_positive_count,
        crd="lora.maxLoras",
    ),
    Knob(
        name="max_lora_rank",
        flag="--max-lora-rank",
        help="the highest adapter rank accepted; slots are sized for it (default {default})",
        default=64,
        parse=parse_positive_count,
        crd="lora.maxLoraRank",
    ),
    Knob(
        name="max_cpu_loras",
        flag="--max-cpu-loras",
        help="adapters loaded in host memory at once, at least {max_loras}; loading more is refused until "
        "one is unloaded (default {default})",
        default=16,
        parse=parse_positive_count,
        crd="lora.maxCpuLoras",
    ),
    Knob(
        name="lora_cache_dir",
        flag="--lora-cache-dir",
        help="where an adapter loaded from an hf:// or http(s):// URI (a lora_path, or a {lora_modules} path) "
        "is fetched to, one folder per URI, kept for the process's life (default: ~/.cache/flotilla/"
        "lora-adapters)",
    ),
)
# The knobs the operator sets (EngineArgs'), and those an InferenceService field sets.
OPERATOR_KNOBS = {name: knob for name, knob in ENGINE_KNOBS.items() if knob.operator_sets}
CRD_KNOBS = {name: knob for name, knob in ENGINE_KNOBS.items() if knob.crd is not None}

# Knobs' flags by name, for the code that names a flag (an error message, a test).
FLAG_MODEL = ENGINE_KNOBS["model"].flag
FLAG_MAX_NUM_SEQS = ENGINE_KNOBS["max_num_seqs"].flag
FLAG_MAX_NUM_BATCHED_TOKENS = ENGINE_KNOBS["max_num_batched_tokens"].flag
FLAG_BLOCK_SIZE = ENGINE_KNOBS["block_size"].flag
FLAG_KV_CACHE_MEMORY = ENGINE_KNOBS["kv_cache_memory"].flag
FLAG_NO_PREFIX_CACHING = ENGINE_KNOBS["enable_prefix_caching"].flag
FLAG_DTYPE = ENGINE_KNOBS["dtype"].flag
FLAG_SCHEDULING_POLICY = ENGINE_KNOBS["scheduling_policy"].flag
FLAG_TENANT_WEIGHTS = ENGINE_KNOBS["tenant_weights"].flag
FLAG_QUANTIZATION = ENGINE_KNOBS["quantization"].flag
FLAG_QUANTIZATION_GROUP_SIZE = ENGINE_KNOBS["quantization_group_size"].flag
FLAG_SPECULATIVE_METHOD = ENGINE_KNOBS["speculative_method"].flag
FLAG_NUM_SPECULATIVE_TOKENS = ENGINE_KNOBS["num_speculative_tokens"].flag
FLAG_SPECULATIVE_MODEL = ENGINE_KNOBS["speculative_model"].flag
FLAG_SPECULATIVE_MAX_BATCH_SIZE = ENGINE_KNOBS["speculative_max_batch_size"].flag
FLAG_ENABLE_LORA = ENGINE_KNOBS["enable_lora"].flag
FLAG_LORA_MODULES = ENGINE_KNOBS["lora_modules"].flag
FLAG_MAX_LORAS = ENGINE_KNOBS["max_loras"].flag
FLAG_MAX_LORA_RANK = ENGINE_KNOBS["max_lora_rank"].flag
FLAG_MAX_CPU_LORAS = ENGINE_KNOBS["max_cpu_loras"].flag
FLAG_LORA_CACHE_DIR = ENGINE_KNOBS["lora_cache_dir"].flag


class EngineArgs:
    """An InferenceService's engine settings, as the engine's flags see them: values for some of the knobs
    the operator sets (OPERATOR_KNOBS), by knob name, in the engine's units (kv_cache_memory in bytes,
    tenant_weights as (tenant, weight) pairs); an unset one (None, or no weights) keeps the engine's default
    and reads as None. `extra_args` are appended verbatim (spec.engine.extraArgs)."""

    __slots__ = ("_values", "extra_args")

    def __init__(self, *, extra_args: Iterable[str] = (), **values: Any) -> None:
        unknown = sorted(set(values) - set(OPERATOR_KNOBS))
        if unknown:
            raise TypeError(f"EngineArgs: {', '.join(unknown)}: no knob the operator sets is called so")
        self._values: dict[str, Any] = {k: v for k, v in values.items() if v is not None and v != ()}
        self.extra_args: tuple[str, ...] = tuple(extra_args)

    def __getattr__(self, name: str) -> Any:
        if name not in OPERATOR_KNOBS:
            raise AttributeError(f"EngineArgs has no knob {name!r}")
        return self._values.get(name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EngineArgs):
            return NotImplemented
        return (self._values, self.extra_args) == (other._values, other.extra_args)

    def __hash__(self) -> int:
        return hash((tuple(sorted(self._values.items())), self.extra_args))

    def __repr__(self) -> str:
        values = "".join(f"{name}={value!r}, " for name, value in self._values.items())
        return f"EngineArgs({values}extra_args={self.extra_args!r})"

    def flags(self) -> list[str]:
        """The flags of the knobs set, in the table's order, then the extra arguments."""
        flags = [
            part
            for name, knob in OPERATOR_KNOBS.items()
            if name in self._values
            for part in knob.argv(self._values[name])
        ]
        return flags + list(self.extra_args)


def engine_serve_argv(
    *,
    model_path: str,
    served_name: str,
    host: str = f"$({ENV_POD_IP})",  # expanded by the kubelet (and the local node agent)
    port: int = ENGINE_PORT,
    shutdown_delay: float | None = None,
    drain_timeout: float | None = None,
    engine: EngineArgs = EngineArgs(),
) -> list[str]:
    """The engine container's command."""
    argv = [*ENGINE_SERVE, FLAG_MODEL, model_path, FLAG_HOST, host, FLAG_PORT, str(port)]
    argv += [FLAG_SERVED_MODEL_NAME, served_name]
    if shutdown_delay is not None:
        argv += [FLAG_SHUTDOWN_DELAY, _seconds(shutdown_delay)]
    if drain_timeout is not None:
        argv += [FLAG_DRAIN_TIMEOUT, _seconds(drain_timeout)]
    return argv + engine.flags()


def model_fetch_argv(uri: str, dest: str) -> list[str]:
    """The init container's command that fetches a model folder (hf://org/name[@rev], http(s)://...tar.gz)."""
    return [*MODEL_FETCH, uri, FLAG_FETCH_DEST, dest]


def _seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
