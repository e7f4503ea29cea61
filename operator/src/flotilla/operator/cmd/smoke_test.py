"""`flotilla operator smoke-test`: the chart's `helm test`. Applies a tiny InferenceService, waits until it
is Ready, asks it for one completion and deletes it; exits 0 only when the completion came back."""

from __future__ import annotations

import argparse
import sys
import time

from flotilla.contract import OPENAI_PATH
from flotilla.operator.api.conditions import is_ready

NAME = "flotilla-helm-test"
SERVED_NAME = "helm-test"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", required=True, help="a Tenant's namespace with quota for one replica")
    parser.add_argument("--model-uri", required=True, help="the model, e.g. file:///models/tiny")
    parser.add_argument("--gpu-type", help="resources.gpuType (default: any)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for Ready")


def service(model_uri: str, gpu_type: str | None) -> dict:
    from flotilla.operator.api.v1alpha1 import GROUP, INFERENCE_SERVICE, VERSION  # pydantic: when run

    resources: dict = {"gpus": 1, **({"gpuType": gpu_type} if gpu_type else {})}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": INFERENCE_SERVICE.kind,
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": model_uri, "servedName": SERVED_NAME},
            "resources": resources,
            "replicas": 1,
        },
    }


def ready_endpoint(obj: dict) -> str | None:
    status = obj.get("status") or {}
    endpoints = status.get("endpoints") or []
    return endpoints[0] if is_ready(obj) and endpoints else None


def run(args: argparse.Namespace) -> int:
    import httpx
    from kubernetes.client.exceptions import ApiException

    from flotilla.operator.api.v1alpha1 import GROUP, INFERENCE_SERVICE, VERSION
    from flotilla.operator.clients.kube import Kube

    kube = Kube(None)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    api = (GROUP, VERSION, args.namespace, INFERENCE_SERVICE.plural)
    try:
        kube.custom.delete_namespaced_custom_object(*api, NAME)  # a leftover from an interrupted run
    except ApiException as exc:
        if exc.status != 404:
            raise
    try:
        kube.custom.create_namespaced_custom_object(*api, service(args.model_uri, args.gpu_type))
    except ApiException as exc:
        say(f"could not apply InferenceService {args.namespace}/{NAME}: {exc.status} {exc.body}")
        return 1
    say(f"applied InferenceService {args.namespace}/{NAME} ({args.model_uri}); waiting for Ready")
    try:
        deadline, endpoint = time.monotonic() + args.timeout, None
        while endpoint is None:
            if time.monotonic() > deadline:
                say(f"not Ready after {args.timeout:.0f}s")
                return 1
            time.sleep(2)
            endpoint = ready_endpoint(kube.custom.get_namespaced_custom_object(*api, NAME))
        body = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4}
        base = endpoint if endpoint.endswith(OPENAI_PATH) else endpoint.rstrip("/") + OPENAI_PATH
        rsp = httpx.post(f"{base}/completions", json=body, timeout=60)
        if rsp.status_code != 200:
            say(f"completion from {base}: HTTP {rsp.status_code} {rsp.text[:300]}")
            return 1
        say(f"completion from {base}: {rsp.json()['choices'][0]['text']!r}")
        return 0
    finally:
        try:
            kube.custom.delete_namespaced_custom_object(*api, NAME)
        except ApiException as exc:
            say(f"could not delete InferenceService {args.namespace}/{NAME}: {exc.status}")
