"""The images, checked without a Docker engine: the Dockerfile is parsed, and what each target installs,
runs and runs as is held against the distributions' pyproject files, the real CLI parser, the contract's
image names and the pods the operator builds (uid 65532, read-only root filesystem, /tmp an emptyDir)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from flotilla import contract
from flotilla.cli import build_parser
from flotilla.operator.api.v1alpha1 import InferenceServiceSpec
from flotilla.operator.config import OperatorConfig
from flotilla.operator.desired.model_source import MOUNT_ROOT
from flotilla.operator.desired.workload import Decision, Owner, deployment

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DISTRIBUTION_DIRS = [ROOT, ROOT / "engine", ROOT / "operator", ROOT / "gateway", ROOT / "bench"]
HEAVY = ("torch", "triton", "transformers")
# The benchmarks (and their plotting) are a distribution of their own that no image builds or installs.
NOT_IN_IMAGES = {"flotilla_bench"}
PLOTTING = ("matplotlib",)

# The image naming: a target is named after the distribution it adds to the root one (`flotilla`), its
# repository is that distribution's name under the contract's registry, and its CLI group is the target's.
TARGETS = {
    "engine": ("flotilla-engine", contract.ENGINE_IMAGE_REPOSITORY, contract.ENGINE_IMAGE),
    "operator": ("flotilla-operator", contract.OPERATOR_IMAGE_REPOSITORY, contract.OPERATOR_IMAGE),
    "gateway": ("flotilla-gateway", contract.GATEWAY_IMAGE_REPOSITORY, contract.GATEWAY_IMAGE),
}
# Environment that points every home and cache a runtime writes into /tmp (the read-only root filesystem).
TMP_ENV = {
    "engine": ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HF_HOME", "TRITON_HOME", "TRITON_CACHE_DIR"),
    "operator": ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"),
    "gateway": ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"),
}


def canonical(name: str) -> str:
    """A distribution's name as its wheel file spells it (PEP 427/503: runs of -_. become _)."""
    return re.sub(r"[-_.]+", "_", name).lower()


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"stage {self.name}: no {keyword}"
        return found[-1]

    def exec_form(self, keyword: str) -> list[str]:
        """ENTRYPOINT/CMD in exec form (a JSON list): the shell form would run under /bin/sh -c, and
        SIGTERM would stop the shell instead of draining the engine."""
        text = self.last(keyword)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), (
            f"stage {self.name}: {keyword} {text} is not in exec form"
        )
        return value

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for args in self.all("ENV"):
            for token in shlex.split(args):
                key, sep, value = token.partition("=")
                assert sep, f"stage {self.name}: ENV {token!r} is not KEY=VALUE"
                values[key] = value
        return values

    def commands(self) -> list[list[str]]:
        """Each RUN's commands (split on &&), as argv, without RUN's own --flags (--mount=...)."""
        argvs = []
        for args in self.all("RUN"):
            tokens = shlex.split(args)
            while tokens and tokens[0].startswith("--"):
                tokens.pop(0)
            argv: list[str] = []
            for token in [*tokens, "&&"]:
                if token == "&&":
                    if argv:
                        argvs.append(argv)
                    argv = []
                else:
                    argv.append(token)
        return argvs


def parse_dockerfile(text: str) -> dict[str, Stage]:
    """Stages by name: line continuations joined, comments dropped (as Docker's parser does)."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)\s+AS\s+(\S+)", args, flags=re.IGNORECASE)
            assert match, f"every stage is named: FROM {args}"
            current = Stage(name=match[2], base=match[1])
            assert current.name not in stages, f"two stages named {current.name}"
            stages[current.name] = current
        else:
            assert current is not None, f"{keyword} before the first FROM"
            current.instructions.append((keyword, args))
    return stages


def lineage(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, base first."""
    chain = [stages[name]]
    while chain[0].base in stages:
        chain.insert(0, stages[chain[0].base])
    return chain


def _distributions() -> dict[str, tuple[Path, dict]]:
    found = {}
    for folder in DISTRIBUTION_DIRS:
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        found[canonical(project["name"])] = (folder, project)
    return found


STAGES = parse_dockerfile(DOCKERFILE.read_text())
DISTRIBUTIONS = _distributions()
ROOT_DISTRIBUTION = canonical(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"])


def _pip_args(argv: list[str], verb: str) -> list[str] | None:
    """The positional arguments of `pip VERB ...` or `python -m pip VERB ...`; None for other commands."""
    if not argv or not (Path(argv[0]).name == "pip" or argv[:3] == ["python", "-m", "pip"]):
        return None
    rest = argv[1:] if Path(argv[0]).name == "pip" else argv[3:]
    if not rest or rest[0] != verb:
        return None
    positional, skip = [], False
    for token in rest[1:]:
        if skip:
            skip = False
        elif token.startswith("-"):
            skip = token in ("--wheel-dir", "-w", "--find-links", "-f", "--index-url", "-i")
        else:
            positional.append(token)
    return positional


def installed(target: str) -> set[str]:
    """The distributions a target's `pip install` lines install: every argument must be one of the
    wheels the builder made (/wheels/NAME-*.whl), so nothing else (torch included) comes in by name."""
    names = set()
    for stage in lineage(STAGES, target):
        for argv in stage.commands():
            for arg in _pip_args(argv, "install") or []:
                match = re.fullmatch(r"/wheels/([a-z0-9_]+)-\*\.whl", arg)
                assert match, f"stage {stage.name} installs {arg!r}: only the builder's wheels, by file"
                names.add(match[1])
    return names


def built_wheels() -> set[str]:
    """The distributions some stage's `pip wheel` builds (their folders, as the builder copies them)."""
    names = set()
    for stage in STAGES.values():
        for argv in stage.commands():
            for arg in _pip_args(argv, "wheel") or []:
                project = tomllib.loads((ROOT / arg / "pyproject.toml").read_text())["project"]
                names.add(canonical(project["name"]))
    return names


def console_scripts(distributions: set[str]) -> dict[str, str]:
    scripts = {}
    for name in distributions:
        scripts.update(DISTRIBUTIONS[name][1].get("scripts", {}))
    return scripts


def test_both_targets_exist_and_the_builder_makes_every_distributions_wheel() -> None:
    assert set(TARGETS) <= set(STAGES)
    assert set(DISTRIBUTIONS) > NOT_IN_IMAGES
    assert built_wheels() == set(DISTRIBUTIONS) - NOT_IN_IMAGES
    for name in TARGETS:
        assert all(stage.name not in TARGETS for stage in lineage(STAGES, name)[:-1]), name
        # Base images are pinned by tag (hadolint checks the same; `make test` runs it).
        base = lineage(STAGES, name)[0].base
        assert ":" in base and not base.endswith(":latest"), base


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_target_installs_the_root_distribution_and_its_own(target: str) -> None:
    distribution = TARGETS[target][0]
    assert installed(target) == {ROOT_DISTRIBUTION, canonical(distribution)}


def test_the_operator_image_has_no_engine_no_torch_no_cuda() -> None:
    assert canonical("flotilla-engine") not in installed("operator")
    for name in installed("operator"):
        for requirement in DISTRIBUTIONS[name][1].get("dependencies", []):
            assert not requirement.lower().startswith(HEAVY), f"{name} requires {requirement}"
    text = " ".join(args for stage in lineage(STAGES, "operator") for _, args in stage.instructions).lower()
    for word in (*HEAVY, "cuda", "flotilla_engine", "./engine"):
        assert word not in text, f"the operator target mentions {word}"


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_no_image_has_the_benchmarks_or_their_plotting(target: str) -> None:
    assert not installed(target) & NOT_IN_IMAGES
    for name in installed(target):
        for requirement in DISTRIBUTIONS[name][1].get("dependencies", []):
            assert not requirement.lower().startswith(PLOTTING), f"{name} requires {requirement}"
    text = " ".join(args for stage in lineage(STAGES, target) for _, args in stage.instructions).lower()
    for word in (*PLOTTING, "mplconfigdir", "./bench", "flotilla_bench"):
        assert word not in text, f"the {target} target mentions {word}"


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_entrypoint_is_a_console_script_on_path_and_cmd_parses(target: str) -> None:
    stage = STAGES[target]
    entrypoint, cmd = stage.exec_form("ENTRYPOINT"), stage.exec_form("CMD")
    scripts = console_scripts(installed(target))
    assert entrypoint[0] in scripts, f"{entrypoint[0]} is no console script of {sorted(installed(target))}"
    assert scripts[entrypoint[0]] == "flotilla.cli:main"
    # The operator replaces the engine's command with `flotilla ...` (contract.ENGINE_SERVE, MODEL_FETCH):
    # the script must be on PATH, which is the venv's bin, where pip puts console scripts.
    assert entrypoint[0] == contract.CLI
    venvs = {
        argv[-1] for s in lineage(STAGES, target) for argv in s.commands() if argv[1:3] == ["-m", "venv"]
    }
    (venv,) = venvs
    assert stage.env()["PATH"].split(":")[0] == f"{venv}/bin"
    # The subcommands parse with the real CLI (argparse exits, failing the test, on anything unknown).
    args = build_parser().parse_args([*entrypoint[1:], *cmd])
    assert args.group == target and callable(args.func)
    if target == "engine":
        assert args.command == "serve"
        assert args.model == MOUNT_ROOT and args.host == "0.0.0.0" and args.port == contract.ENGINE_PORT
        assert stage.all("EXPOSE") == [str(contract.ENGINE_PORT)]
    else:
        assert args.command == "run"


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_target_runs_as_the_pods_uid_on_a_read_only_root_filesystem(target: str) -> None:
    stage = STAGES[target]
    # Numeric, so that the kubelet can check runAsNonRoot without reading the image's /etc/passwd.
    assert stage.last("USER") == f"{contract.IMAGE_UID}:{contract.IMAGE_UID}"
    created = " ".join(" ".join(argv) for argv in stage.commands() if argv[0] in ("useradd", "groupadd"))
    assert set(re.findall(r"--(?:uid|gid) (\d+)", created)) == {str(contract.IMAGE_UID)}
    env = stage.env()
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    for key in TMP_ENV[target]:
        assert env[key] == "/tmp" or env[key].startswith("/tmp/"), f"{target}: {key}={env.get(key)}"
    for key, value in env.items():
        if re.search(r"(HOME|CACHE|CACHE_DIR|CONFIG|CONFIGDIR|CACHE_PATH)$", key):
            assert value.startswith("/tmp"), f"{target}: {key}={value} is outside /tmp"
    # Bytecode is compiled while building: at run time nothing can write it.
    installs = [argv for s in lineage(STAGES, target) for argv in s.commands() if _pip_args(argv, "install")]
    assert installs and all("--no-compile" not in argv for argv in installs)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_image_names_follow_the_contract(target: str) -> None:
    distribution, repository, image = TARGETS[target]
    assert repository == f"{contract.IMAGE_REGISTRY}/{distribution}"
    assert image == f"{repository}:{contract.IMAGE_TAG}"
    # Tagged with the release: every distribution's version.
    assert {project["version"] for _, project in DISTRIBUTIONS.values()} == {contract.IMAGE_TAG}
    # What the Dockerfile's header and the install page tell people to build is the same name (and each
    # does tell: a page that lost its build lines would pass vacuously).
    for doc in (DOCKERFILE, ROOT / "docs" / "install.md"):
        builds = re.findall(r"--target (\w+) +-t (\S+)", doc.read_text())
        assert builds, f"{doc.name} shows no `docker build --target T -t NAME`"
        for built_target, tag in builds:
            assert built_target in TARGETS and tag == TARGETS[built_target][2], f"{doc.name}: {tag}"


def test_the_operator_runs_the_engine_image_as_its_user() -> None:
    assert OperatorConfig().default_image == contract.ENGINE_IMAGE
    spec = InferenceServiceSpec.model_validate({"model": {"uri": "hf://org/name"}, "resources": {"gpus": 1}})
    owner = Owner(name="chat", namespace="team-a", uid="uid-1")
    dep = deployment(owner, spec, Decision(tenant="team-a", replicas=1), OperatorConfig())
    pod = dep["spec"]["template"]["spec"]
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] == context["runAsGroup"] == context["fsGroup"] == contract.IMAGE_UID
    (container,) = pod["containers"]
    assert container["image"] == contract.ENGINE_IMAGE
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The one writable place the images' environment points at is /tmp, an emptyDir.
    tmp = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    assert {"name": tmp, "emptyDir": {}} in pod["volumes"]
    for init in pod.get("initContainers", []):
        assert init["image"] == contract.ENGINE_IMAGE
        assert init["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_build_context_sends_what_the_builder_copies() -> None:
    """.dockerignore allows only listed paths; each COPY source must be one of them (or inside one)."""
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for stage in STAGES.values():
        for args in stage.all("COPY"):
            if "--from=" in args:  # from another stage, not from the context
                continue
            tokens = [t for t in shlex.split(args) if not t.startswith("--")]
            for source in tokens[:-1]:
                source = source.rstrip("/")
                assert any(
                    source == a or a.startswith(source + "/") or source.startswith(a + "/") for a in allowed
                ), f"COPY {source}: .dockerignore leaves it out"


def test_the_charts_pods_run_their_targets_entry_point() -> None:
    """Every pod the Helm chart makes runs the operator image (the gateway's: the gateway image), with the
    target's ENTRYPOINT as the command; each Deployment's arguments start with its target's CMD."""
    from flotilla.cluster.helm import helm

    stages = parse_dockerfile(DOCKERFILE.read_text())
    rendered = helm(
        "template", "flotilla", str(ROOT / "charts" / "flotilla"),
        "--set", "tests.namespace=team-a", "--set", "tests.modelUri=file:///m",
    ).stdout  # fmt: skip
    pods = []
    for doc in yaml.safe_load_all(rendered):
        if doc and doc["kind"] in ("Deployment", "Job"):
            target = "gateway" if doc["metadata"]["name"] == "flotilla-gateway" else "operator"
            pods.append((doc["kind"], target, doc["spec"]["template"]["spec"]))
        elif doc and doc["kind"] == "Pod":
            pods.append(("Pod", "operator", doc["spec"]))
    assert {kind for kind, _, _ in pods} == {"Deployment", "Job", "Pod"}
    assert {target for _, target, _ in pods} == {"operator", "gateway"}
    for kind, target, spec in pods:
        stage = stages[target]
        entrypoint, cmd = stage.exec_form("ENTRYPOINT"), stage.exec_form("CMD")
        for container in spec["containers"]:
            assert container["image"] == TARGETS[target][2], kind
            assert container["command"] == entrypoint, kind
            if kind == "Deployment":
                assert container["args"][: len(cmd)] == cmd
