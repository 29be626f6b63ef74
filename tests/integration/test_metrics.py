"""Every service's Prometheus /metrics, scraped from real processes registered in a real
Redis (and a `pdserve planner --dry-run` deciding for them) and parsed with
prometheus_client's parser: names, types and labels, counters and histograms moving by
exactly what a known set of requests did, the metrics addresses in the registry and
`pdserve status --json`, and the Grafana dashboard's every query."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.local.launcher import Child
from pdserve.testing.cluster import Cluster
from pdserve.testing.metrics import families, samples, scrape, value
from tests.helpers.clusters import running
from tests.helpers.flags import ENGINE
from tests.helpers.planner_profile import write_tiny_profile

ROOT = Path(__file__).resolve().parents[2]

PREFIX = "metrics-test"
BLOCK = 16
MAX_TOKENS = 6
# Distinct prompts (no block in common), the first one sent twice: its second prefill
# finds its two full blocks in the prefix cache.
PROMPTS = [
    [11 + i for i in range(40)],
    [200 + i for i in range(23)],
    [300 + 2 * i for i in range(50)],
    [11 + i for i in range(40)],
]
REPEAT_HIT_TOKENS = 32
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve.json"
LABELLED = {"model_name", "role"}


@pytest.fixture(scope="module")
def cluster(tiny_chat_llama_path, shared_redis_server, tmp_path_factory):
    reg = ["--redis-url", shared_redis_server.url, "--redis-prefix", PREFIX]
    model = ["--model", str(tiny_chat_llama_path)]
    with running(tmp_path_factory.mktemp("metrics-logs")) as c:
        c.start(
            "kvstore",
            "pdserve.kvstore",
            "--capacity-bytes",
            "64MiB",
            *reg,
            ready=("kvstore-metrics",),
        )
        # KV over gRPC: these counts are the kvstore path's (NIXL's: test_nixl_cluster).
        grpc = ["--kv-transport", "grpc"]
        for role in ("prefill", "decode"):
            c.start(
                role, f"pdserve.{role}", *reg, *model, *ENGINE, *grpc, ready=(f"{role}-metrics",)
            )
        gw = c.start("gateway", "pdserve.gateway", *reg, *model, "--served-model-name", "tiny")
        c.metrics_urls = {
            "gateway": f"http://{gw.addresses['gateway-http']}",
            **{
                role: f"http://{c.services[i].addresses[role + '-metrics']}"
                for i, role in enumerate(("kvstore", "prefill", "decode"))
            },
        }
        c.http_address = gw.addresses["gateway-http"]
        _wait_for_pools(c.metrics_urls["gateway"])
        planner = _start_planner(c, reg, tmp_path_factory.mktemp("planner"))
        c.metrics_urls["planner"] = f"http://{planner.address}"
        yield c


def _start_planner(c: Cluster, reg: list[str], folder: Path) -> Child:
    """`pdserve planner --dry-run` over the cluster: its gateway's metrics, its registry."""
    argv = [sys.executable, "-m", "pdserve.cli", "planner", *reg]
    argv += ["--gateway-metrics", f"{c.metrics_urls['gateway']}/metrics"]
    argv += ["--profile", str(write_tiny_profile(folder)), "--dry-run"]
    argv += ["--host", "127.0.0.1", "--metrics-port", "0", "--interval", "0.5", "--window", "2"]
    return c.launcher.start_ready("planner", argv, ["planner"], timeout=60)


def _wait_for_pools(gateway_url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pool_workers = families(scrape(gateway_url))["pdserve:pool_workers"]
        pools = {s.labels["pool"] for s in pool_workers.samples if s.value}
        if pools >= {"prefill", "decode", "kvstore"}:
            return
        time.sleep(0.1)
    raise AssertionError("the gateway did not see all three pools in 30 s")


# (family, type) every service of a role exposes
EXPECTED = {
    "gateway": {
        ("pdserve:num_requests_running", "gauge"),
        ("pdserve:num_requests_waiting", "gauge"),
        ("pdserve:time_to_first_token_seconds", "histogram"),
        ("pdserve:inter_token_latency_seconds", "histogram"),
        ("pdserve:request_time_per_output_token_seconds", "histogram"),
        ("pdserve:e2e_request_latency_seconds", "histogram"),
        ("pdserve:request_queue_time_seconds", "histogram"),
        ("pdserve:request_prompt_tokens", "histogram"),
        ("pdserve:request_generation_tokens", "histogram"),
        ("pdserve:prompt_tokens", "counter"),
        ("pdserve:generation_tokens", "counter"),
        ("pdserve:prompt_tokens_cached", "counter"),
        ("pdserve:request_success", "counter"),
        ("pdserve:prefill_requests", "counter"),
        ("pdserve:worker_retries", "counter"),
        ("pdserve:stream_migrations", "counter"),
        ("pdserve:pool_workers", "gauge"),
    },
    "worker": {
        ("pdserve:num_requests_running", "gauge"),
        ("pdserve:num_requests_waiting", "gauge"),
        ("pdserve:kv_cache_usage_perc", "gauge"),
        ("pdserve:prefix_cache_queries", "counter"),
        ("pdserve:prefix_cache_hits", "counter"),
        ("pdserve:num_preemptions", "counter"),
        ("pdserve:prompt_tokens", "counter"),
        ("pdserve:generation_tokens", "counter"),
        ("pdserve:request_success", "counter"),
        ("pdserve:time_to_first_token_seconds", "histogram"),
        ("pdserve:e2e_request_latency_seconds", "histogram"),
        ("pdserve:request_queue_time_seconds", "histogram"),
        ("pdserve:request_prefill_time_seconds", "histogram"),
        ("pdserve:request_decode_time_seconds", "histogram"),
        ("pdserve:request_inference_time_seconds", "histogram"),
        ("pdserve:kv_transfer_bytes", "counter"),
        ("pdserve:kv_transfer_blocks", "counter"),
        ("pdserve:kv_transfer_seconds", "histogram"),
        ("pdserve:kv_transfer_failures", "counter"),
        ("process_cpu_seconds", "counter"),
    },
    "kvstore": {
        ("pdserve:kvstore_bytes_used", "gauge"),
        ("pdserve:kvstore_capacity_bytes", "gauge"),
        ("pdserve:kvstore_blocks", "gauge"),
        ("pdserve:kvstore_bytes_in", "counter"),
        ("pdserve:kvstore_bytes_out", "counter"),
        ("pdserve:kvstore_blocks_in", "counter"),
        ("pdserve:kvstore_evictions", "counter"),
        ("pdserve:kvstore_request_seconds", "histogram"),
    },
    "planner": {
        ("pdserve:planner_desired_replicas", "gauge"),
        ("pdserve:planner_current_replicas", "gauge"),
        ("pdserve:planner_predicted_ttft_seconds", "gauge"),
        ("pdserve:planner_predicted_itl_seconds", "gauge"),
        ("pdserve:planner_observed_request_rate", "gauge"),
        ("pdserve:planner_decisions", "counter"),
        ("pdserve:planner_errors", "counter"),
    },
}


def _families_of_kind(role: str) -> set[tuple[str, str]]:
    return EXPECTED["worker" if role in ("prefill", "decode") else role]


def _complete(http: httpx.Client, prompt: list[int]) -> dict:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


@pytest.fixture(scope="module")
def measured(cluster):
    """Scrapes of every service before and after PROMPTS, and the requests' usage."""
    before = {role: scrape(url) for role, url in cluster.metrics_urls.items()}
    with httpx.Client(base_url=f"http://{cluster.http_address}", timeout=60) as http:
        usages = [_complete(http, p) for p in PROMPTS]
    # Workers count a request when its stream ends, a moment after the client has it all.
    deadline = time.monotonic() + 10
    while True:
        after = {role: scrape(url) for role, url in cluster.metrics_urls.items()}
        done = value(after["decode"], "pdserve:request_success_total") - value(
            before["decode"], "pdserve:request_success_total"
        )
        decided = value(after["planner"], "pdserve:planner_decisions_total") > 0
        if (done >= len(PROMPTS) and decided) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return before, after, usages


def test_every_service_exposes_its_series_with_their_types_and_labels(measured):
    _, after, _ = measured
    for role, text in after.items():
        exposed = families(text)
        types = {(f.name, f.type) for f in exposed.values()}
        missing = _families_of_kind(role) - types
        assert not missing, f"{role} lacks {sorted(missing)}"
        for f in exposed.values():
            if not f.name.startswith("pdserve:"):
                continue
            for s in f.samples:
                assert s.labels["role"] == role, (role, s)
                if role == "kvstore":
                    assert "model_name" not in s.labels, s
                else:
                    assert s.labels["model_name"] == "tiny", s
    buckets = [
        s.labels["le"]
        for s in families(after["gateway"])["pdserve:time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket")
    ]
    assert buckets[:4] == ["0.001", "0.005", "0.01", "0.02"] and buckets[-1] == "+Inf"  # vLLM's


def test_counters_and_histograms_move_by_what_the_requests_did(measured):
    before, after, usages = measured

    def delta(role: str, sample: str, **labels: str) -> float:
        return value(after[role], sample, **labels) - value(before[role], sample, **labels)

    n = len(PROMPTS)
    completion = sum(u["completion_tokens"] for u in usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    assert completion == n * MAX_TOKENS and prompt == sum(map(len, PROMPTS))
    blocks = sum(-(-len(p) // BLOCK) for p in PROMPTS)

    # The gateway: what the client got.
    assert delta("gateway", "pdserve:generation_tokens_total") == completion
    assert delta("gateway", "pdserve:prompt_tokens_total") == prompt
    assert delta("gateway", "pdserve:request_success_total", finished_reason="length") == n
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta("gateway", f"pdserve:{histogram}_count") == n
    assert delta("gateway", "pdserve:inter_token_latency_seconds_count") == completion - n
    assert delta("gateway", "pdserve:request_generation_tokens_sum") == completion
    assert delta("gateway", "pdserve:prefill_requests_total", where="remote") == n
    assert delta("gateway", "pdserve:routed_requests_total", pool="decode") == n
    assert delta("gateway", "pdserve:routed_requests_total", pool="prefill") == n
    assert delta("gateway", "pdserve:prompt_tokens_cached_total") == REPEAT_HIT_TOKENS

    # The prefill pool sampled each first token; the decode pool generated the rest.
    assert delta("prefill", "pdserve:generation_tokens_total") == n
    assert delta("decode", "pdserve:generation_tokens_total") == completion - n
    assert delta("prefill", "pdserve:request_success_total", finished_reason="prefilled") == n
    assert delta("decode", "pdserve:request_success_total", finished_reason="length") == n
    assert delta("prefill", "pdserve:time_to_first_token_seconds_count") == n
    assert delta("decode", "pdserve:inter_token_latency_seconds_count") == completion - 2 * n
    for role in ("prefill", "decode"):
        assert delta(role, "pdserve:prompt_tokens_total") == prompt
        assert delta(role, "pdserve:prefix_cache_queries_total") == prompt
        assert delta(role, "pdserve:prefix_cache_hits_total") == REPEAT_HIT_TOKENS, role
        assert delta(role, "pdserve:request_queue_time_seconds_count") == n
        assert value(after[role], "pdserve:num_requests_running") == 0

    # KV transfer: every prompt block pushed once; the kvstore took them all.
    pushed = delta("prefill", "pdserve:kv_transfer_blocks_total", direction="push")
    pushed_bytes = delta("prefill", "pdserve:kv_transfer_bytes_total", direction="push")
    assert pushed == blocks
    assert delta("kvstore", "pdserve:kvstore_blocks_in_total") == blocks
    assert delta("kvstore", "pdserve:kvstore_bytes_in_total") == pushed_bytes > 0
    assert delta("prefill", "pdserve:kv_transfer_seconds_count", direction="push") == n
    fetched = delta("decode", "pdserve:kv_transfer_blocks_total", direction="fetch")
    # The repeat's two full blocks were in the decode worker's own cache: not fetched.
    assert fetched == blocks - REPEAT_HIT_TOKENS // BLOCK
    assert delta("kvstore", "pdserve:kvstore_blocks_out_total") == fetched
    assert delta("decode", "pdserve:kv_blocks_imported_total") == fetched
    # Nothing failed, and the failure series exist at 0 (alerts need them before a fault).
    for role, direction in (("prefill", "push"), ("decode", "fetch")):
        failures = "pdserve:kv_transfer_failures_total"
        assert value(after[role], failures, direction=direction) == 0
        exposed = families(after[role])["pdserve:kv_transfer_failures"].samples
        assert any(s.name == failures for s in exposed)


def test_the_registry_and_status_show_each_metrics_address(cluster, shared_redis_server):
    status = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--json"]
        + ["--redis-url", shared_redis_server.url, "--redis-prefix", PREFIX],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert status.returncode == 0, status.stderr
    pools = json.loads(status.stdout)["pools"]
    for role in ("prefill", "decode", "kvstore"):
        (worker,) = pools[role]["workers"]
        url = f"http://{worker['metrics_address']}/metrics"
        assert url == cluster.metrics_urls[role] + "/metrics"
        assert httpx.get(url, timeout=10).status_code == 200


def dashboard_queries(path: Path) -> list[str]:
    """Every PromQL expression of a Grafana dashboard: panel targets and variable queries."""
    board = json.loads(path.read_text())
    panels, out = list(board["panels"]), []
    while panels:
        panel = panels.pop()
        panels += panel.get("panels", [])
        out += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
    for variable in board.get("templating", {}).get("list", []):
        query = variable.get("query")
        if variable.get("type") == "query" and query:
            out.append(query["query"] if isinstance(query, dict) else query)
    return out


def test_every_dashboard_query_refers_to_exposed_metrics(measured):
    _, after, _ = measured
    exposed = {s.name for text in after.values() for s in samples(text)}
    queries = dashboard_queries(DASHBOARD)
    assert len(queries) >= 20
    referred = set()
    for q in queries:
        names = set(re.findall(r"\b((?:pdserve:|process_)[A-Za-z0-9_:]*)", q))
        assert names, f"a query that names no pdserve metric: {q}"
        referred |= names
    assert sorted(referred - exposed) == []
