"""`flotilla operator release-finalizers`: the chart's pre-delete hook.

Helm deletes the operator but keeps the CRDs (resource policy keep), so tenants' InferenceServices and
Tenants outlive it. kopf's finalizer on them would then make every later delete wait for an operator that
is gone. So, before Helm deletes anything: delete the webhook configuration (Helm is about to; with the
operator stopped, its failurePolicy Fail would refuse the patches below), scale the operator to zero (so
that no replica adds the finalizer back), wait until its pods are gone, and remove the finalizer from
every object that has it, and the metering finalizer from every engine pod.
"""

from __future__ import annotations

import argparse
import sys
import time

OPERATOR_POD_LABEL = "app.kubernetes.io/name=flotilla-operator"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", required=True, help="the operator's namespace")
    parser.add_argument("--deployment", default="flotilla-operator", help="the operator's Deployment")
    parser.add_argument(
        "--webhook-configuration", help="the ValidatingWebhookConfiguration to delete first (the chart's)"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for its pods to go")


def finalizer() -> str:
    from flotilla.operator.api.v1alpha1 import GROUP  # pydantic: imported when the command runs

    return f"{GROUP}/finalizer"  # lifecycle.py gives kopf's finalizer this name


def without_finalizer(finalizers: list[str] | None, name: str) -> list[str] | None:
    """The finalizers without `name`; None when it was not there (nothing to patch)."""
    finalizers = list(finalizers or [])
    if name not in finalizers:
        return None
    return [f for f in finalizers if f != name]


def run(args: argparse.Namespace) -> int:
    from kubernetes.client.exceptions import ApiException

    from flotilla.operator.api.v1alpha1 import GROUP, INFERENCE_SERVICE, TENANT, VERSION
    from flotilla.operator.clients.kube import Kube

    kube = Kube(None)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    if args.webhook_configuration:
        from kubernetes import client

        try:
            client.AdmissionregistrationV1Api(kube.apps.api_client).delete_validating_webhook_configuration(
                args.webhook_configuration
            )
            say(f"deleted ValidatingWebhookConfiguration {args.webhook_configuration}")
        except ApiException as exc:
            if exc.status != 404:
                raise
    try:
        kube.apps.patch_namespaced_deployment_scale(
            args.deployment, args.namespace, {"spec": {"replicas": 0}}
        )
        say(f"scaled deployment {args.namespace}/{args.deployment} to 0")
    except ApiException as exc:
        if exc.status != 404:
            raise
    deadline = time.monotonic() + args.timeout
    while True:
        pods = kube.core.list_namespaced_pod(args.namespace, label_selector=OPERATOR_POD_LABEL).items
        if not pods:
            break
        if time.monotonic() > deadline:
            say(f"{len(pods)} operator pod(s) still running after {args.timeout:.0f}s; releasing anyway")
            break
        time.sleep(1)
    released = 0
    for kind, namespaced in ((INFERENCE_SERVICE, True), (TENANT, False)):
        listing: dict = kube.custom.list_cluster_custom_object(GROUP, VERSION, kind.plural)  # type: ignore[assignment]
        for item in listing.get("items", []):
            meta = item["metadata"]
            kept = without_finalizer(meta.get("finalizers"), finalizer())
            if kept is None:
                continue
            # The resourceVersion makes the patch conditional: a concurrent change is retried by the Job.
            patch = {"metadata": {"finalizers": kept, "resourceVersion": meta["resourceVersion"]}}
            if namespaced:
                kube.custom.patch_namespaced_custom_object(
                    GROUP, VERSION, meta["namespace"], kind.plural, meta["name"], patch
                )
            else:
                kube.custom.patch_cluster_custom_object(GROUP, VERSION, kind.plural, meta["name"], patch)
            released += 1
            say(f"released {kind.kind} {meta.get('namespace', '')}/{meta['name']}".replace(" /", " "))
    say(f"released the finalizer {finalizer()} from {released} object(s)")
    # Engine pods keep their metering finalizer until an operator meters their end; with none left,
    # a pod deleted later would wait for ever. What they ran until now was metered by the last round.
    from flotilla.operator.clients.kube import MERGE
    from flotilla.operator.naming import MANAGED_BY, MANAGED_BY_LABEL, METERING_FINALIZER

    pods = kube.core.list_pod_for_all_namespaces(label_selector=f"{MANAGED_BY_LABEL}={MANAGED_BY}").items
    released = 0
    for pod in pods:
        kept = without_finalizer(pod.metadata.finalizers, METERING_FINALIZER)
        if kept is None:
            continue
        patch = {"metadata": {"finalizers": kept, "resourceVersion": pod.metadata.resource_version}}
        kube.core.patch_namespaced_pod(pod.metadata.name, pod.metadata.namespace, patch, _content_type=MERGE)
        released += 1
    say(f"released the finalizer {METERING_FINALIZER} from {released} engine pod(s)")
    return 0
