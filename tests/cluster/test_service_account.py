"""In-cluster config for pods: the service env, the implicit ServiceAccount volume, bound tokens."""

import datetime as dt

from flotilla.cluster.service_account import (
    DEFAULT_SERVICEACCOUNT_PATH,
    IMPLICIT_VOLUME,
    TokenSource,
    api_endpoint,
    service_env,
    token_request,
    with_api_access,
)

POD = {
    "metadata": {"name": "op", "namespace": "sys", "uid": "u-9"},
    "spec": {
        "serviceAccountName": "operator",
        "initContainers": [{"name": "init"}],
        "containers": [{"name": "main", "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
        "volumes": [{"name": "data", "emptyDir": {}}],
    },
}


def test_endpoint_and_env_point_at_the_real_api_server():
    assert api_endpoint("https://127.0.0.1:36443") == ("127.0.0.1", 36443)
    env = service_env("127.0.0.1", 36443)
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert env["KUBERNETES_SERVICE_PORT"] == env["KUBERNETES_SERVICE_PORT_HTTPS"] == "36443"
    assert env["KUBERNETES_PORT"] == "tcp://127.0.0.1:36443"


def test_the_volume_is_added_to_every_container_lacking_it():
    pod = with_api_access(POD, lambda: {"metadata": {"name": "operator"}})
    assert pod is not POD and "volumes" in POD["spec"] and len(POD["spec"]["volumes"]) == 1  # input untouched
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["data", IMPLICIT_VOLUME]
    for group in ("initContainers", "containers"):
        mounts = pod["spec"][group][0]["volumeMounts"]
        assert {"name": IMPLICIT_VOLUME, "mountPath": DEFAULT_SERVICEACCOUNT_PATH, "readOnly": True} in mounts


def test_automount_false_on_the_pod_or_the_account_means_no_volume():
    def never_asked():
        raise AssertionError("the pod's own setting decides")

    off = {**POD, "spec": {**POD["spec"], "automountServiceAccountToken": False}}
    assert with_api_access(off, never_asked) is off
    assert with_api_access(POD, lambda: {"automountServiceAccountToken": False}) is POD
    assert with_api_access(POD, lambda: None) is POD  # no such account: nothing to mount


def test_a_pod_already_mounting_it_is_left_alone():
    mount = {"name": "kube-api-access-x", "mountPath": DEFAULT_SERVICEACCOUNT_PATH}
    spec = {**POD["spec"], "initContainers": [], "containers": [{"name": "main", "volumeMounts": [mount]}]}
    pod = {**POD, "spec": spec}
    assert with_api_access(pod, lambda: {}) is pod


def test_token_request_is_bound_to_the_pod():
    body = token_request(POD, "vault", 600)
    assert body["spec"]["boundObjectRef"] == {"apiVersion": "v1", "kind": "Pod", "name": "op", "uid": "u-9"}
    assert body["spec"]["audiences"] == ["vault"] and body["spec"]["expirationSeconds"] == 600
    assert "audiences" not in token_request(POD, None, 3607)["spec"]


def test_tokens_are_cached_until_80_percent_of_their_life():
    now = [dt.datetime(2030, 1, 1, tzinfo=dt.UTC)]
    calls: list[tuple[str, dict]] = []

    def post(path: str, body: dict) -> dict:
        calls.append((path, body))
        expires = now[0] + dt.timedelta(seconds=body["spec"]["expirationSeconds"])
        return {
            "status": {
                "token": f"t{len(calls)}",
                "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
        }

    source = TokenSource(POD, post, clock=lambda: now[0])
    assert source.token({"expirationSeconds": 1000}) == "t1"
    assert calls[0][0] == "/api/v1/namespaces/sys/serviceaccounts/operator/token"
    now[0] += dt.timedelta(seconds=799)
    assert source.token({"expirationSeconds": 1000}) == "t1"
    now[0] += dt.timedelta(seconds=2)
    assert source.token({"expirationSeconds": 1000}) == "t2"
    assert source.token({"expirationSeconds": 1000, "audience": "other"}) == "t3"  # cached per audience
