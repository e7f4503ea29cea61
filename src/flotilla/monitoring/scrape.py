"""How a Prometheus finds and scrapes what Flotilla runs: kubernetes_sd over pods, keeping those annotated
`prometheus.io/scrape: "true"` (the operator annotates every engine pod; the chart annotates the operator
and the gateway), at the annotated port and path, labelled `namespace` and `pod` as the usual
`kubernetes-pods` job does; and a second job, `flotilla-envoy`, for Envoy's own series in the gateway pods:
a pod's annotations name one port, so Envoy's stats port is found by its container port name
(`envoy-stats`, at /stats/prometheus), as service meshes find their proxies'. One source for `flotilla
monitoring up`, the plain scrape file in deploy/monitoring/ and the e2e tests. Pure: it returns dicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.contract import (
    ANNOTATION_PATH,
    ANNOTATION_PORT,
    ANNOTATION_SCRAPE,
    ENVOY_STATS_PATH,
    ENVOY_STATS_PORT_NAME,
)

JOB = "flotilla-pods"
ENVOY_JOB = "flotilla-envoy"


def _meta(annotation: str) -> str:
    """The kubernetes_sd meta label of a pod annotation (non-alphanumerics become underscores)."""
    return "__meta_kubernetes_pod_annotation_" + "".join(c if c.isalnum() else "_" for c in annotation)


@dataclass(frozen=True)
class ApiAccess:
    """How Prometheus reaches the Kubernetes API: in-cluster (all None) or from outside the cluster."""

    api_server: str | None = None
    ca_file: str | None = None
    token_file: str | None = None


def _pod_sd(access: ApiAccess, namespaces: list[str] | None) -> dict:
    sd: dict = {"role": "pod"}
    if access.api_server:
        sd["api_server"] = access.api_server
    if access.ca_file:
        sd["tls_config"] = {"ca_file": access.ca_file}
    if access.token_file:
        sd["authorization"] = {"credentials_file": access.token_file}
    if namespaces:
        sd["namespaces"] = {"names": sorted(namespaces)}
    return sd


_POD_LABELS = [
    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
]


def pod_scrape_job(access: ApiAccess = ApiAccess(), namespaces: list[str] | None = None) -> dict:
    sd = _pod_sd(access, namespaces)
    return {
        "job_name": JOB,
        # The operator's own series carry `namespace` (of the service they describe); honouring scraped
        # labels keeps it, instead of renaming it exported_namespace under the pod's namespace.
        "honor_labels": True,
        "kubernetes_sd_configs": [sd],
        "relabel_configs": [
            {"source_labels": [_meta(ANNOTATION_SCRAPE)], "action": "keep", "regex": "true"},
            # kubernetes_sd makes one target per declared container port; keep one per pod.
            {"source_labels": ["__meta_kubernetes_pod_container_init"], "action": "drop", "regex": "true"},
            {
                "source_labels": ["__address__", _meta(ANNOTATION_PORT)],
                "action": "replace",
                "regex": r"([^:]+)(?::\d+)?;(\d+)",
                "replacement": "$1:$2",
                "target_label": "__address__",
            },
            {
                "source_labels": [_meta(ANNOTATION_PATH)],
                "action": "replace",
                "regex": "(.+)",
                "target_label": "__metrics_path__",
            },
            *_POD_LABELS,
        ],
    }


def envoy_scrape_job(access: ApiAccess = ApiAccess(), namespaces: list[str] | None = None) -> dict:
    """Envoy in the gateway pods: the one target per pod whose container port is named `envoy-stats` (the
    sidecar's; kubernetes_sd lists init containers' ports too), at Envoy's Prometheus path."""
    return {
        "job_name": ENVOY_JOB,
        "kubernetes_sd_configs": [_pod_sd(access, namespaces)],
        "metrics_path": ENVOY_STATS_PATH,
        "relabel_configs": [
            {
                "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                "action": "keep",
                "regex": ENVOY_STATS_PORT_NAME,
            },
            *_POD_LABELS,
        ],
    }


def prometheus_config(
    access: ApiAccess = ApiAccess(),
    *,
    namespaces: list[str] | None = None,
    static_targets: dict[str, list[str]] | None = None,
    rule_files: list[str] | None = None,
    interval: str = "15s",
) -> dict:
    """A whole prometheus.yml. `static_targets` (job -> host:port, or host:port/path where the series are
    not at /metrics, such as Envoy's /stats/prometheus) is for what runs outside the cluster, such as an
    operator started on the host by `flotilla demo`."""
    jobs = [pod_scrape_job(access, namespaces), envoy_scrape_job(access, namespaces)]
    for job, targets in sorted((static_targets or {}).items()):
        addresses = sorted(target.partition("/")[0] for target in targets)
        paths = {"/" + target.partition("/")[2] if "/" in target else "/metrics" for target in targets}
        if len(paths) != 1:
            raise ValueError(f"static_targets[{job!r}]: one path per job, not {sorted(paths)}")
        static = {"job_name": job, "honor_labels": True, "static_configs": [{"targets": addresses}]}
        if (path := paths.pop()) != "/metrics":
            static["metrics_path"] = path
        jobs.append(static)
    config: dict = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": jobs,
    }
    if rule_files:
        config["rule_files"] = list(rule_files)
    return config


def in_cluster_config(rules_file: str) -> str:
    """prometheus.yml for a Prometheus running in the cluster without the Prometheus operator: the pod
    job with in-cluster credentials, and Flotilla's rules file mounted beside it."""
    from flotilla import manifest_yaml

    header = (
        "# Generated by `flotilla monitoring scrape` from src/flotilla/monitoring/scrape.py: do not edit.\n"
        "# For a Prometheus in the cluster without the Prometheus operator: mount this as prometheus.yml\n"
        f"# and deploy/monitoring/{rules_file} beside it; its ServiceAccount needs get/list/watch on pods.\n"
    )
    return header + manifest_yaml.dump(prometheus_config(rule_files=[rules_file]), sort_keys=False, width=110)


# What Prometheus's own ServiceAccount may do: list and watch pods, nothing else.
DISCOVERY_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
