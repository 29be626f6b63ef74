"""The chart's planner runs (autoscaling.mode planner, dryRun): what the chart renders, started
as local processes (tests/helpers/chart_pods.py), with the planner's pod among them. It reads
its profile from its ConfigMap volume, every gateway pod's metrics through the headless
Service, and the pools from the registry; while chats go through the gateway Service it logs
a decision for each pool every interval, says what it would set, and exports its decisions
on its metrics port. The release starts each pool's Deployment at one pod (the planner owns
their replicas): the decode pool's minimum of two is what the planner would set."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from pdserve.testing.metrics import scrape, value
from tests.helpers.chart_pods import LocalCluster, scrape_every_pod
from tests.helpers.helm_chart import local_model_values, render
from tests.helpers.planner_profile import tiny_profile

START_S = 120.0
DECIDE_S = 60.0
# A decision of the prefill pool at a rate the chats made (its text: "0.80 req/s, ...").
PREFILL_DECISION = re.compile(r"^prefill: (up|down|hold) (\d+) -> (\d+) \((\w+)\): ([\d.]+) req/s")
DECODE_DECISION = re.compile(r"^decode: up (\d+) -> 2 \(bounds\)")
DRY_RUN = "dry run: decode pool would be set to 2"


@pytest.fixture
def cluster(tmp_path, tiny_chat_llama_path):
    model = str(tiny_chat_llama_path)
    manifests = render(
        set_values={
            # One gateway: the headless Service names one gateway pod here.
            **local_model_values(model),
            "autoscaling.mode": "planner",
            "planner.profile": json.dumps(tiny_profile().to_json()),
            "planner.dryRun": True,
            "planner.interval": 1,
            "planner.window": 4,
            "decode.autoscaling.minReplicas": 2,
        }
    )
    c = LocalCluster(manifests, tmp_path)
    try:
        c.start(timeout=START_S)
        yield c
    finally:
        c.stop()
    codes = {r.child.name: r.child.proc.returncode for r in c.running}
    assert all(code == 0 for code in codes.values()), f"not a clean drain on SIGTERM: {codes}"


def planner_messages(cluster: LocalCluster) -> list[str]:
    """The messages of the planner's log (--log-format json: one object a line)."""
    (planner,) = [r for r in cluster.running if r.pod.component == "planner"]
    out = []
    for line in planner.child.log_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record["logger"] == "pdserve.planner":
                out.append(record["message"])
    return out


def chat(base: str, api_key: str, n: int) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"{n} the quick brown fox"}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {api_key}"}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text


def decided(messages: list[str]) -> bool:
    """Whether the log has each pool's decision (the prefill pool's at a rate above 0) and
    the dry run's would-be scale of the decode pool."""
    prefill = [m for m in messages if (d := PREFILL_DECISION.match(m)) and float(d.group(5)) > 0]
    return bool(prefill) and any(DECODE_DECISION.match(m) for m in messages) and DRY_RUN in messages


def test_the_charts_planner_decides_for_each_pool_in_a_dry_run(cluster):
    assert sorted(p.component for p in cluster.pods) == [
        "decode",
        "gateway",
        "kvstore",
        "planner",
        "prefill",
        "redis",
    ]
    base = "http://" + cluster.service_address("t-pdserve-gateway", "http")
    api_key = cluster.secrets["t-pdserve"]["api-key"]
    deadline = time.monotonic() + DECIDE_S
    n = 0
    while not decided(planner_messages(cluster)):
        assert time.monotonic() < deadline, "\n".join(planner_messages(cluster)[-20:])
        chat(base, api_key, n)
        n += 1
        time.sleep(0.2)
    messages = planner_messages(cluster)
    assert any(m.startswith("planner (dry run) with profile tiny-float32-avx2") for m in messages)

    # Prometheus' path to the planner's metrics: its pod's metrics port, like every pod's.
    scraped = scrape_every_pod(cluster)
    text = scrape(scraped["t-pdserve-planner-0"])
    labels = {"model_name": "tiny", "role": "planner"}
    desired = "pdserve:planner_desired_replicas"
    assert value(text, desired, pool="prefill", **labels) >= 1
    assert value(text, desired, pool="decode", **labels) == 2
    assert value(text, "pdserve:planner_current_replicas", pool="decode", **labels) == 1
    bounds = {"pool": "decode", "direction": "up", "reason": "bounds"}
    assert value(text, "pdserve:planner_decisions_total", **bounds, **labels) >= 1
