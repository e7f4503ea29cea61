"""Operator-wide settings: what the desired state depends on besides the InferenceService itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from flotilla.contract import ENGINE_IMAGE

ENGINE_SHUTDOWN_DELAY = 5  # seconds the engine serves on after SIGTERM while endpoints drop it


@dataclass(frozen=True)
class OperatorConfig:
    # The engine image when a spec names none. The local cluster ignores images and runs the command.
    default_image: str = ENGINE_IMAGE
    # When set, hf://org/name resolves to <hf_cache_dir>/org/name on the node (the local cluster's model
    # cache); when unset, an init container downloads the model into an emptyDir.
    hf_cache_dir: str | None = None
    # Whether file:// model paths are checked on the operator's own filesystem. True where the operator
    # shares the nodes' filesystem (the local cluster); a real cluster's operator cannot see node disks.
    check_local_model_paths: bool = True
    # Seconds the engine gets to finish in-flight requests after SIGTERM.
    termination_grace_seconds: int = 60
    # Startup probe budget for slow model loads: period x failures.
    startup_probe_period_seconds: int = 5
    startup_probe_failures: int = 120
    # The autoscaler's metrics source: unset, it scrapes each engine pod's /metrics; set, it asks this
    # Prometheus server (which must label engine series with namespace and pod) with PromQL.
    prometheus_url: str | None = None
    # The installation's master token (--engine-token-file): when set, each namespace with engines gets the
    # Secret flotilla.contract.ENGINE_TOKEN_SECRET holding engine_token(master, namespace), and engines get
    # ENV_INTERNAL_TOKEN from it. Unset: no Secret, no variable. Kept out of repr (and so out of logs).
    engine_token_master: str | None = field(default=None, repr=False)
    # Whether each InferenceService gets an InferencePool (the Gateway API Inference Extension's, which
    # must then be installed: crds/, the chart). Off with --no-inference-pools.
    inference_pools: bool = True
    # The namespace of Flotilla's gateway (the operator's own, --operator-namespace): the parent the
    # operator reports InferencePool status for (desired/inference_pool.py).
    gateway_namespace: str = "flotilla-system"
