"""What the monitoring tests share: the series the project exports, the labels a series may be grouped by,
and every promtool here."""

from __future__ import annotations

import shutil

import pytest

from flotilla import contract
from flotilla.monitoring import rules

# Labels a rule or a panel may aggregate or match by: bounded by the cluster's objects or fixed sets.
# Anything per request or per user (a request id, an API key, a user name) must never become a series.
BOUNDED_LABELS = frozenset(
    {
        contract.LABEL_TENANT,
        contract.LABEL_NAMESPACE,
        contract.LABEL_SERVICE,
        contract.LABEL_GPU_TYPE,
        contract.LABEL_REASON,
        contract.LABEL_TRIGGER,
        contract.LABEL_LE,
        contract.LABEL_LORA_NAME,  # a loaded LoRA adapter: at most --max-cpu-loras per engine
        "job",  # Prometheus's target labels, for `up`
        "instance",
    }
)


def _exported_series() -> set[str]:
    """Every sample name the engine, the operator and the gateway expose, from their own registries, and the
    Envoy series the contract lists (tests/gateway/test_envoy_stats.py finds each in a real Envoy's
    /stats/prometheus)."""
    from prometheus_client import REGISTRY

    import flotilla.operator.autoscaling.metrics
    import flotilla.operator.metrics
    import flotilla.operator.tenancy.metering_metrics  # noqa: F401 (registers the tenant collector)
    from flotilla.engine.core.outputs import EngineStats, LoRAStats
    from flotilla.engine.server.metrics import EngineMetrics
    from flotilla.gateway.metrics import GatewayMetrics

    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_count", "_sum"),
        "summary": ("_count", "_sum", ""),
    }
    names = set()
    # An engine with --enable-lora (max_loras set) also exports the per-adapter series.
    lora = EngineStats(max_loras=1, loras={"a": LoRAStats()})
    engine = EngineMetrics("m", lambda: EngineStats()).registry
    lora_engine = EngineMetrics("m", lambda: lora).registry
    for registry in (engine, lora_engine, REGISTRY, GatewayMetrics().registry):
        for family in registry.collect():
            names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names | contract.ENVOY_SERIES


@pytest.fixture(scope="session")
def exported_series() -> set[str]:
    return _exported_series()


@pytest.fixture(scope="session")
def known_series(exported_series: set[str]) -> set[str]:
    """What a query may read: an exported series, a recorded one, or one Prometheus records itself."""
    return exported_series | {r.name for r in rules.records()} | rules.PROMETHEUS_SERIES


@pytest.fixture(scope="session")
def bounded_labels() -> frozenset[str]:
    return BOUNDED_LABELS


def _promtools() -> list[str]:
    """Every promtool here: the one `flotilla cluster build` makes (the newest) and the one on PATH."""
    found = []
    try:
        from flotilla.cluster.paths import promtool_path

        built = promtool_path()
        if built.exists():
            found.append(str(built))
    except ImportError:
        pass
    on_path = shutil.which("promtool")
    if on_path:
        found.append(on_path)
    return found


PROMTOOLS = _promtools()


@pytest.fixture(params=PROMTOOLS or [""], ids=lambda p: p or "no-promtool")
def promtool(request: pytest.FixtureRequest) -> str:
    """Each promtool in turn; the test is skipped where there is none."""
    if not request.param:
        pytest.skip("promtool is not installed (run `flotilla cluster build`, or put promtool on PATH)")
    return request.param
