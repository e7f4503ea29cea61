"""The layout's promises: a file's path is its import path, the operator needs no torch, the contract is
stdlib-only and is the one place its names are spelled, what two parts need is written once (in the root
distribution), installed code never looks for the checkout, and the benchmarks (flotilla-bench) are the
products' users, never their parts."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flotilla import contract, disconnect, fetch_uri, openai_errors, ownership, quantity, timestamps

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = [
    ROOT / "src",
    ROOT / "engine" / "src",
    ROOT / "operator" / "src",
    ROOT / "gateway" / "src",
    ROOT / "bench" / "src",
]
HEAVY = ("torch", "triton", "transformers")
# The distributions that run in production (the images install some of them); flotilla-bench is the other.
PRODUCTS = [".", "engine", "operator", "gateway"]
PLOTTING = ("matplotlib",)
BENCH = "flotilla.bench"


def _modules() -> list[tuple[str, Path]]:
    found = []
    for root in SOURCE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found.append((name, path))
    return found


def test_every_file_imports_under_the_name_its_path_says() -> None:
    wrong = []
    for name, path in _modules():
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or Path(spec.origin).resolve() != path.resolve():
            wrong.append(f"{path.relative_to(ROOT)} -> {name}: {spec and spec.origin}")
    assert not wrong, "\n".join(wrong)


def test_flotilla_is_a_namespace_package_shared_by_five_distributions() -> None:
    assert not any((root / "flotilla" / "__init__.py").exists() for root in SOURCE_ROOTS)
    names = {
        tomllib.loads((d / "pyproject.toml").read_text())["project"]["name"]
        for d in (ROOT, ROOT / "engine", ROOT / "operator", ROOT / "gateway", ROOT / "bench")
    }
    assert names == {"flotilla", "flotilla-engine", "flotilla-operator", "flotilla-gateway", "flotilla-bench"}


@pytest.mark.parametrize("project", [".", "operator", "gateway"])
def test_the_operator_and_gateway_declare_no_torch_triton_or_transformers(project: str) -> None:
    meta = tomllib.loads((ROOT / project / "pyproject.toml").read_text())["project"]
    declared = " ".join(meta["dependencies"]).lower()
    assert not [name for name in HEAVY if name in declared]


@pytest.mark.parametrize("project", PRODUCTS)
def test_no_product_declares_matplotlib(project: str) -> None:
    """Plotting is the benchmarks': only flotilla-bench declares matplotlib."""
    meta = tomllib.loads((ROOT / project / "pyproject.toml").read_text())["project"]
    declared = " ".join(meta["dependencies"]).lower()
    assert not [name for name in PLOTTING if name in declared]
    bench = tomllib.loads((ROOT / "bench" / "pyproject.toml").read_text())["project"]
    assert all(name in " ".join(bench["dependencies"]).lower() for name in PLOTTING)


def test_the_root_modules_never_import_the_benchmarks() -> None:
    """What import-linter checks of the product packages (.importlinter), for the root distribution's own
    modules (import-linter takes only packages as roots): none imports flotilla.bench. The CLI names the
    benchmarks' command modules only as strings, for importlib."""
    offenders = []
    for path in sorted((ROOT / "src" / "flotilla").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno} {name}"
                for name in names
                if name == BENCH or name.startswith(BENCH + ".")
            ]
    assert not offenders, "\n".join(offenders)


def test_without_the_benchmarks_every_product_module_imports_and_bench_says_where_they_are() -> None:
    """In a process where flotilla.bench cannot be imported (the images: flotilla-bench is not installed),
    every product module imports, and each group's `bench` command, whatever its arguments, says in one line
    that the benchmarks are in flotilla-bench and how to install it."""
    names = [n for n, _ in _modules() if not n.startswith(BENCH)]
    script = f"""
import contextlib, importlib, importlib.abc, io, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == {BENCH!r} or name.startswith({BENCH!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
for name in {names!r}:
    importlib.import_module(name)
from flotilla.cli import main
for argv in (["engine", "bench"], ["engine", "bench", "serve", "--url", "http://x"], ["gateway", "bench", "routing"],
             ["operator", "bench", "--services", "5"], ["engine", "bench", "--help"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    lines = err.getvalue().splitlines()
    assert code == 2 and len(lines) == 1, (argv, code, lines)
    assert lines[0].startswith(f"flotilla {{argv[0]}} bench: "), lines
    assert "flotilla-bench" in lines[0] and "pip install -e bench" in lines[0], lines
assert not [m for m in sys.modules if m.startswith({BENCH!r})]
print(len({names!r}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout) == len(names) > 50


def test_with_the_benchmarks_each_group_has_its_bench_commands() -> None:
    """With flotilla-bench installed (as `make install` does), the root CLI attaches each group's benchmarks."""
    from flotilla.cli import build_parser

    parser = build_parser()
    for argv in (["engine", "bench", "serve", "--url", "http://x"], ["gateway", "bench", "overhead"],
                 ["operator", "bench", "--services", "5"]):  # fmt: skip
        args = parser.parse_args(argv)
        assert callable(args.func) and args.func.__module__.startswith(f"{BENCH}.{argv[0]}."), argv


def test_the_operator_gateway_and_cli_import_where_torch_cannot() -> None:
    """Every operator, gateway, cluster and CLI module, and the gateway's and the operator's benchmarks,
    imports in a process where torch, triton and transformers raise ImportError, as in the operator's image."""
    names = [n for n, _ in _modules() if not n.startswith(("flotilla.engine", "flotilla.bench.engine"))]
    script = f"""
import importlib, importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            raise ImportError(f"{{name}} is not installed in the operator's image")
sys.meta_path.insert(0, Block())
for name in {names!r}:
    importlib.import_module(name)
print(len({names!r}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout) == len(names) > 50


SHARED = [contract, ownership, openai_errors, quantity, timestamps, disconnect, fetch_uri]


@pytest.mark.parametrize("module", SHARED, ids=[m.__name__.rpartition(".")[2] for m in SHARED])
def test_the_shared_rules_import_only_the_standard_library(module) -> None:
    """The contract, the ownership rule and the root's shared helpers are imported by the parts, the
    gateway's I/O-free core included: they may need nothing the parts do not all have. One may import
    another of them (the contract's knob table reads byte sizes with flotilla.quantity), which this test
    holds to the same rule."""
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    shared = {m.__name__ for m in SHARED}
    outside = {name.split(".")[0] for name in imported - shared}
    assert outside - {"__future__"} <= set(sys.stdlib_module_names)


def _contract_strings() -> dict[str, str]:
    """Every distinctive name the contract spells: metric names, environment variables, flags, paths.
    (Label names such as `model` are ordinary words and appear in other roles too.)"""
    distinctive = ("flotilla_", "FLOTILLA_", "--", "/", "POD_IP")
    values = {}
    for attr, value in vars(contract).items():
        if attr.isupper() and isinstance(value, str) and value.startswith(distinctive):
            values[value] = attr
            if value.startswith(
                "flotilla_"
            ):  # a counter's exposed name is a copy too (the engine's and the operator's)
                values[contract.counter_total(value)] = attr
    return values


# The engine's benchmarks declare flags of their own (other defaults, other meanings), not the contract's.
NOT_CONTRACT_CODE = ("bench/src/flotilla/bench/engine/",)


def test_engine_operator_gateway_and_bench_spell_no_contract_name_themselves() -> None:
    """Metric names, flags, environment variables and paths come from flotilla.contract, never copied."""
    spelled = _contract_strings()
    copies = []
    for root in SOURCE_ROOTS[1:]:
        for path in root.rglob("*.py"):
            if str(path.relative_to(ROOT)).startswith(NOT_CONTRACT_CODE):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in spelled:
                    copies.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r} (use contract.{spelled[node.value]})"
                    )
    assert not copies, "\n".join(copies)


def _strings(path: Path) -> Iterator[tuple[int, str]]:
    """The string constants of a module, but for the values of a `Literal[...]` (a type spells its values;
    tests/operator/test_scheduling.py checks the CRD's against the contract)."""
    tree = ast.parse(path.read_text())
    typed = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal"
        for inner in ast.walk(node.slice)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in typed:
            yield node.lineno, node.value


_ERROR_TYPES = {openai_errors.error_type(status) for status in range(400, 600)} | {"not_found_error"}
_RFC3339 = re.compile(r"%Y-%m-%dT%H:%M:%S(\.%f)?Z")


def _error_type(s: str) -> bool:
    return s in _ERROR_TYPES


def _time_format(s: str) -> bool:  # a strftime format, or the "Z" -> "+00:00" of a parser
    return bool(_RFC3339.search(s)) or s == "+00:00"


def _binary_suffix(s: str) -> bool:  # Ki, Mi, Gi ...
    return len(s) == 2 and s in quantity.SUFFIXES


def _disconnect(s: str) -> bool:
    return s == "http.disconnect"


def _archive_suffix(s: str) -> bool:  # what an http(s) fetch URI must end with (.tar.gz, .tgz, .tar)
    return s in fetch_uri.ARCHIVE_SUFFIXES


def _policy(s: str) -> bool:  # the benchmarks name their runs by policy (NOT_CONTRACT_CODE)
    return s == contract.SCHEDULING_FCFS


# What two parts need, written once: its one home, what it is, how a copy shows, and where it may show.
ONE_HOME: list[tuple[str, str, Callable[[str], bool], tuple[str, ...]]] = [
    ("src/flotilla/openai_errors.py", "an OpenAI error type", _error_type, ()),
    ("src/flotilla/timestamps.py", "an RFC 3339 time's format", _time_format, ()),
    ("src/flotilla/quantity.py", "a Kubernetes quantity's binary suffix", _binary_suffix, ()),
    ("src/flotilla/disconnect.py", "the ASGI disconnect message", _disconnect, ()),
    ("src/flotilla/contract.py", "a scheduling policy's name", _policy, NOT_CONTRACT_CODE),
    ("src/flotilla/fetch_uri.py", "a fetch URI's archive suffix", _archive_suffix, ()),
]


@pytest.mark.parametrize(
    ("home", "what", "spells", "exempt"), ONE_HOME, ids=[r[2].__name__ for r in ONE_HOME]
)
def test_what_two_parts_need_is_written_once(
    home: str, what: str, spells: Callable[[str], bool], exempt: tuple[str, ...]
) -> None:
    """The OpenAI error body, Kubernetes quantities, RFC 3339 times, the client-disconnect race, the
    scheduling policies and the fetch URIs' archive suffixes each have one home; a second copy (one once disagreed with the first) fails here."""
    copies = []
    for _, path in _modules():
        where = str(path.relative_to(ROOT))
        if where == home or (exempt and where.startswith(exempt)):
            continue
        copies += [f"{where}:{line} {value!r}" for line, value in _strings(path) if spells(value)]
    assert not copies, f"{what} spelled outside {home}:\n" + "\n".join(copies)


def test_installed_code_never_looks_for_the_checkout() -> None:
    offenders = []
    for _, path in _modules():
        text = path.read_text()
        for needle in ("PYTHONSAFEPATH", ".parents["):
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not offenders, "\n".join(offenders)


def test_every_yaml_flotilla_writes_goes_through_manifest_yaml() -> None:
    """PyYAML's own dumpers leave `766e7` plain, and the API server reads it as a number (a label value
    in e2e did once); every product, benchmark and test writes YAML through `flotilla.manifest_yaml`."""
    dumpers = re.compile(r"\byaml\.(safe_dump|safe_dump_all|dump|dump_all|SafeDumper|Dumper)\b")
    files = (
        [p for _, p in _modules()] + sorted((ROOT / "tests").rglob("*.py")) + sorted(ROOT.glob("e2e/*.py"))
    )
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        if path.name != "manifest_yaml.py" and path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if dumpers.search(line)
    ]
    assert not offenders, "YAML written without flotilla.manifest_yaml:\n" + "\n".join(offenders)
