"""/metrics: the names and labels of DESIGN.md's contract, promtool's lint, and a real Prometheus that
scrapes the engine and answers histogram_quantile(0.95, ...) over TTFT."""

from __future__ import annotations

import subprocess
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from flotilla.cluster.paths import promtool_path
from flotilla.cluster.prometheus import PrometheusProcess

BODY = {"model": "tiny", "prompt": "count me", "max_tokens": 5, "ignore_eos": True}
CONTRACT = {
    "flotilla_time_to_first_token_seconds": "histogram",
    "flotilla_inter_token_latency_seconds": "histogram",
    "flotilla_e2e_request_latency_seconds": "histogram",
    "flotilla_num_requests_running": "gauge",
    "flotilla_num_requests_waiting": "gauge",
    "flotilla_kv_cache_usage_ratio": "gauge",
    "flotilla_prefix_cache_queries": "counter",
    "flotilla_prefix_cache_hits": "counter",
    "flotilla_prompt_tokens": "counter",
    "flotilla_generation_tokens": "counter",
    "flotilla_num_preemptions": "counter",
    "flotilla_request_success": "counter",
    "flotilla_model_weight_bytes": "gauge",
    "flotilla_model_info": "gauge",
    "flotilla_spec_decode_num_drafts": "counter",
    "flotilla_spec_decode_num_draft_tokens": "counter",
    "flotilla_spec_decode_num_accepted_tokens": "counter",
    "flotilla_spec_decode_num_accepted_tokens_per_pos": "counter",
}


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    text = httpx.get(f"{url}/metrics", trust_env=False).text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(metrics: dict, name: str, **labels) -> float:
    return sum(v for k, v in metrics.get(name, {}).items() if all((lk, lv) in k for lk, lv in labels.items()))


def test_contract_names_types_and_labels(server):
    text = httpx.get(f"{server.url}/metrics", trust_env=False).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in CONTRACT.items():
        assert families[name].type == kind, name
        for sample in families[name].samples:
            assert {"model", "tenant", "service"} <= set(sample.labels), sample
            assert sample.labels["model"] == "tiny"
    buckets = [
        s.labels["le"] for s in families["flotilla_time_to_first_token_seconds"].samples if "le" in s.labels
    ]
    assert buckets[0] == "0.001" and float(buckets[-2]) >= 60  # 1 ms to minutes


def test_the_model_info_says_the_quantization_and_the_weight_bytes(server, http):
    metrics = scrape(server.url)
    info = server.llm.model_info
    assert value(metrics, "flotilla_model_weight_bytes") == info.weight_bytes > 0
    (labels,) = metrics["flotilla_model_info"]
    assert ("quantization", "none") in labels and ("dtype", "float32") in labels
    (card,) = http.get("/v1/models").json()["data"]
    assert (card["quantization"], card["quantization_group_size"]) == ("none", None)
    assert card["weight_bytes"] == info.weight_bytes


def test_speculative_decoding_counters_match_the_engine(make_server, tiny_model):
    from flotilla.contract import SPEC_DECODE_ACCEPTED_PER_POSITION, counter_total

    # The model drafts for itself: every greedy draft is accepted.
    engine = {
        "speculative_method": "draft",
        "speculative_model": str(tiny_model),
        "num_speculative_tokens": 3,
    }
    spec_server = make_server(engine)
    body = {**BODY, "max_tokens": 24, "temperature": 0}
    assert httpx.post(f"{spec_server.url}/v1/completions", json=body, trust_env=False).status_code == 200
    spec_server.assert_no_leak()
    stats = spec_server.llm.stats().spec_decode
    metrics = scrape(spec_server.url)
    assert value(metrics, "flotilla_spec_decode_num_drafts_total") == stats.num_drafts
    assert value(metrics, "flotilla_spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert value(metrics, "flotilla_spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
    per_position = metrics[counter_total(SPEC_DECODE_ACCEPTED_PER_POSITION)]
    assert sorted(dict(k)["position"] for k in per_position) == [
        "0",
        "1",
        "2",
    ]  # every position from the start
    assert [
        value(metrics, counter_total(SPEC_DECODE_ACCEPTED_PER_POSITION), position=str(i)) for i in range(3)
    ] == (stats.accepted_per_position)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_counters_follow_requests(server, http):
    before = scrape(server.url)
    n = http.post("/tokenize", json={"prompt": "count me"}).json()["count"]
    assert http.post("/v1/completions", json=BODY).status_code == 200
    after = scrape(server.url)
    assert value(after, "flotilla_prompt_tokens_total") - value(before, "flotilla_prompt_tokens_total") == n
    assert (
        value(after, "flotilla_generation_tokens_total") - value(before, "flotilla_generation_tokens_total")
        == 5
    )
    key = "flotilla_request_success_total"
    assert value(after, key, finish_reason="length") - value(before, key, finish_reason="length") == 1
    for hist in ("flotilla_time_to_first_token_seconds", "flotilla_e2e_request_latency_seconds"):
        assert value(after, hist + "_count") - value(before, hist + "_count") == 1
    itl = "flotilla_inter_token_latency_seconds_count"
    assert value(after, itl) - value(before, itl) == 4


def test_promtool_check_metrics_passes(server, http):
    promtool = promtool_path()
    assert promtool.exists(), f"{promtool} is missing: run `flotilla cluster build` (make test does)"
    http.post("/v1/completions", json=BODY)
    text = httpx.get(f"{server.url}/metrics", trust_env=False).text
    proc = subprocess.run(
        [str(promtool), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_real_prometheus_answers_ttft_p95(make_server, monkeypatch, tmp_path, wait_for):
    monkeypatch.setenv("FLOTILLA_TENANT", "team-a")
    monkeypatch.setenv("FLOTILLA_SERVICE", "chat")
    server = make_server()
    target = server.url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "engine", "static_configs": [{"targets": [target]}]}],
    }
    query = (
        "histogram_quantile(0.95, sum by (le, tenant, service) "
        '(rate(flotilla_time_to_first_token_seconds_bucket{tenant="team-a",service="chat"}[30s])))'
    )
    answers = []

    def answered() -> bool:
        time.sleep(0.25)  # a gentle poll: one request and one query per round
        httpx.post(f"{server.url}/v1/completions", json=BODY, trust_env=False)  # keep traffic flowing
        try:
            resp = httpx.get(f"{prom.url}/api/v1/query", params={"query": query}, trust_env=False)
        except httpx.TransportError:
            return False
        result = resp.json()["data"]["result"] if resp.status_code == 200 else []
        answers[:] = [float(r["value"][1]) for r in result if r["value"][1] not in ("NaN", "+Inf")]
        return bool(answers)

    with PrometheusProcess(config, tmp_path / "prometheus") as prom:
        wait_for(answered, timeout=120, what="Prometheus to answer the TTFT p95 query")
    assert 0 < answers[0] < 300
