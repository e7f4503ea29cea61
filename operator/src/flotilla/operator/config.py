"""Operator-wide settings: what the desired state depends on besides the InferenceService itself."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from flotilla.contract import ENGINE_IMAGE

ENGINE_SHUTDOWN_DELAY = 5  # seconds the engine serves on after SIGTERM while endpoints drop it


@dataclass(frozen=True)
class OperatorConfig:
    # The engine image when a spec names none. The local cluster ignores images and runs the command.
    default_image: str = ENGINE_IMAGE
    # When set, hf://org/name resolves to <hf_cache_dir>/org/name on the node (the local cluster's model
    # cache); when unset, an init container downloads the model into an emptyDir. The platform's own folder,
    # so not one of host_path_roots: tenants name only what lies under it.
    hf_cache_dir: str | None = None
    # The node folders (absolute) that tenants' host paths may name (--host-path-root, the chart's
    # operator.hostPathRoots): a file:// model uri and spec.engine.lora.adapterDir must equal one or lie
    # under one (desired/host_paths.py), or the webhook and the reconciler refuse the service. Empty, the
    # default: no tenant-named host path at all, since a hostPath of the tenant's choice is node access
    # (/etc/kubernetes, /var/lib/kubelet) for someone who may not create pods.
    host_path_roots: tuple[str, ...] = ()
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

    def __post_init__(self) -> None:
        if self.hf_cache_dir and not self.hf_cache_dir.startswith("/"):
            raise ValueError(f"--hf-cache-dir {self.hf_cache_dir!r}: not an absolute path")
        object.__setattr__(self, "host_path_roots", host_path_roots(self.host_path_roots))


def host_path_roots(roots: Iterable[str]) -> tuple[str, ...]:
    """The roots as a tuple, as given (desired/host_paths.allowed normalizes both sides when it compares;
    this layer imports nothing of desired/). A ValueError names a relative one: it would mean the
    operator's working directory, nothing on the nodes, so it is refused at start, not silently useless."""
    out = tuple(map(str, roots))
    for root in out:
        if not root.startswith("/"):
            raise ValueError(
                f"--host-path-root {root!r}: not an absolute path (like /var/lib/flotilla/models)"
            )
    return out
