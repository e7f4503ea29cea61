"""The operator's only writes to the Kubernetes API: server-side apply of children, status merge-patches.

Reads come from kopf's watch-fed indexes (handlers.py), so a steady-state reconcile makes no GET calls.
Every call is counted in flotilla_operator_api_calls_total, for the scale benchmark's calls-per-reconcile.
"""

from __future__ import annotations

import json
from pathlib import Path

from kubernetes import client, config

from flotilla.operator.api import inference_extension as gie
from flotilla.operator.api.v1alpha1 import GROUP, INFERENCE_SERVICE, VERSION
from flotilla.operator.metrics import API_CALLS
from flotilla.operator.naming import FIELD_MANAGER

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


class Kube:
    def __init__(self, kubeconfig: Path | None = None):
        api_client = self._load(kubeconfig)
        self.configuration: client.Configuration = api_client.configuration
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.policy = client.PolicyV1Api(api_client)
        self.discovery = client.DiscoveryV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    @staticmethod
    def _load(kubeconfig: Path | None) -> client.ApiClient:
        configuration = client.Configuration()
        if kubeconfig is None:
            try:
                config.load_incluster_config(client_configuration=configuration)
            except config.ConfigException:
                config.load_kube_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        # Handler threads share one client; size the pool for them.
        configuration.connection_pool_maxsize = 32
        return client.ApiClient(configuration)

    def apply(self, obj: dict) -> None:
        """Server-side apply with field manager `flotilla`; force takes back fields others changed (drift)."""
        kind, meta = obj["kind"], obj["metadata"]
        api = {
            "Deployment": self.apps.patch_namespaced_deployment,
            "Service": self.core.patch_namespaced_service,
            "PodDisruptionBudget": self.policy.patch_namespaced_pod_disruption_budget,
            "Secret": self.core.patch_namespaced_secret,
            "EndpointSlice": self.discovery.patch_namespaced_endpoint_slice,
            gie.KIND: self._patch_inference_pool,
        }[kind]
        API_CALLS.labels(verb="apply", resource=kind).inc()
        response = api(
            meta["name"],
            meta["namespace"],
            obj,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type=APPLY,
            _preload_content=False,
        )
        _drain(response)

    def _patch_inference_pool(self, name: str, namespace: str, body: dict, **kwargs):
        return self.custom.patch_namespaced_custom_object(
            gie.GROUP, gie.VERSION, namespace, gie.PLURAL, name, body, **kwargs
        )

    def ensure_peering(self, name: str) -> bool:
        """Creates the ClusterKopfPeering `name` if kopf's peering CRD is installed and the object is not.

        A Helm chart cannot ship a custom object beside the CRD that defines it in one release, so the
        operator makes its own meeting place. False when the CRD is absent (kopf then runs standalone)."""
        from kubernetes.client.exceptions import ApiException

        API_CALLS.labels(verb="create", resource="clusterkopfpeerings").inc()
        body = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}
        try:
            self.custom.create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", body)
        except ApiException as exc:
            if exc.status == 404:
                return False
            if exc.status != 409:
                raise
        return True

    def patch_service_status(self, namespace: str, name: str, status: dict) -> None:
        """The one write of an InferenceService's status: a merge patch, so the fields `status` does not
        name are kept. Two writers own disjoint parts: the reconciler (controllers/sync.py) everything
        desired/status.py computes, the autoscaler (controllers/autoscaling.py) status.autoscaling."""
        API_CALLS.labels(verb="patch", resource="inferenceservices/status").inc()
        response = self.custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            INFERENCE_SERVICE.plural,
            name,
            {"status": status},
            _content_type=MERGE,
            _preload_content=False,
        )
        _drain(response)

    def patch_pool_status(self, namespace: str, name: str, resource_version: str, status: dict) -> None:
        """An InferencePool's status (desired/inference_pool.py). status.parents is one atomic list that
        every gateway controller of the pool writes, so the patch carries the resourceVersion the list was
        read at: the API server refuses it (409) when another writer came first."""
        API_CALLS.labels(verb="patch", resource=f"{gie.PLURAL}/status").inc()
        response = self.custom.patch_namespaced_custom_object_status(
            gie.GROUP,
            gie.VERSION,
            namespace,
            gie.PLURAL,
            name,
            {"metadata": {"resourceVersion": resource_version}, "status": status},
            _content_type=MERGE,
            _preload_content=False,
        )
        _drain(response)


def _drain(response) -> None:
    """Read the body we do not need (parsing it into models costs more than the call), so the pooled
    connection is clean for the next request."""
    response.read()
    response.release_conn()


def api_error_message(exc: Exception) -> str:
    """The API server's own words from an ApiException (its Status message), else the exception."""
    try:
        return json.loads(getattr(exc, "body", "") or "{}").get("message") or str(exc)
    except ValueError:
        return str(exc)
