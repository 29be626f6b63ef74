"""The chart runs: what it renders, started as local processes (tests/helpers/chart_pods.py),
serves a chat through the gateway Service (not ready until its decode pool is up), and
`pdserve status` (as NOTES.txt runs it, inside the gateway's pod) lists every pool, from a
registry that asks for a password and holds signed entries; every pod is scraped on its
metrics port, and the decode pool is rolled under streaming clients. Only the values a user would set differ from the defaults:
the model (the tiny random Llama on a hostPath), its engine settings, and one gateway (the
defaults' two decode workers run)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections import Counter

import httpx
import pytest
import redis

from pdserve.controlplane.signing import Verifier
from pdserve.testing.metrics import metric
from tests.helpers.chart_pods import LocalCluster, scrape_every_pod
from tests.helpers.helm_chart import local_model_values, render

START_S = 120.0
WAIT_S = 30.0
MAX_TOKENS = 8
# Several KV blocks long, so that the router weighs each decode worker's load.
LONG = "the quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture
def cluster(tmp_path, tiny_chat_llama_path):
    model = str(tiny_chat_llama_path)
    manifests = render(set_values=local_model_values(model))
    c = LocalCluster(manifests, tmp_path)
    try:
        # The decode pool last: until a decode worker registers, the gateway is alive but
        # not ready (a load balancer sends it nothing).
        c.start(timeout=START_S, later=("decode",))
        base = "http://" + c.service_address("t-pdserve-gateway", "http")
        deadline = time.monotonic() + START_S
        while True:
            try:
                health = httpx.get(f"{base}/health", timeout=5).status_code
            except httpx.HTTPError:
                health = None
            if health == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert health == 200
        not_ready = httpx.get(f"{base}/ready", timeout=5)
        assert not_ready.status_code == 503, not_ready.text
        c.start_later(timeout=START_S)
        assert httpx.get(f"{base}/ready", timeout=5).status_code == 200
        yield c
    finally:
        c.stop()
    codes = {r.child.name: r.child.proc.returncode for r in c.running}
    assert all(code == 0 for code in codes.values()), f"not a clean drain on SIGTERM: {codes}"


def status(cluster: LocalCluster) -> dict:
    """`pdserve status --json` with the gateway container's env (`kubectl exec`)."""
    done = subprocess.run(
        ["pdserve", "status", "--json"],
        env=cluster.exec_env("gateway"),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def pool_addresses(body: dict) -> dict[str, set[str]]:
    return {role: {w["address"] for w in p["workers"]} for role, p in body["pools"].items()}


def wait_for_pools(cluster: LocalCluster, expected: dict[str, set[str]]) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        body = status(cluster)
        if pool_addresses(body) == expected:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"registry {pool_addresses(body)}, expected {expected}")
        time.sleep(0.2)


def chat(base: str, api_key: str | None, content: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)


async def chats(base: str, api_key: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        body = {
            "model": "tiny",
            "max_tokens": 32,
            "temperature": 0,
            "ignore_eos": True,
        }
        return await asyncio.gather(
            *(
                client.post(
                    f"{base}/v1/chat/completions",
                    json={**body, "messages": [{"role": "user", "content": f"{i} {LONG}"}]},
                    headers={"Authorization": f"Bearer {api_key}"},
                )
                for i in range(n)
            )
        )


async def stream_chat(client: httpx.AsyncClient, base: str, api_key: str, content: str):
    """(status, finish_reason, completion tokens) of one streamed chat, read to its end."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api_key}"}
    finish, tokens = None, None
    async with client.stream(
        "POST", f"{base}/v1/chat/completions", json=body, headers=headers
    ) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        return r.status_code, finish, tokens


async def roll_under_streams(cluster: LocalCluster, base: str, api_key: str):
    """Roll the decode pool while 4 clients stream chats one after another."""
    done = asyncio.Event()
    results: list[tuple] = []

    async def client(i: int) -> None:
        async with httpx.AsyncClient(timeout=60) as h:
            n = 0
            while not done.is_set():
                results.append(await stream_chat(h, base, api_key, f"{i} {n} {LONG}"))
                n += 1

    clients = [asyncio.create_task(client(i)) for i in range(4)]
    try:
        new = await asyncio.to_thread(cluster.roll, "decode", START_S)
    finally:
        done.set()
        await asyncio.gather(*clients)
    return new, results


def test_rendered_chart_serves_a_chat_and_lists_every_pool(cluster):
    pods = {p.component: [] for p in cluster.pods}
    for p in cluster.pods:
        pods[p.component].append(p)
    assert {c: len(ps) for c, ps in pods.items()} == {
        "gateway": 1,
        "prefill": 1,
        "decode": 2,
        "kvstore": 1,
        "redis": 1,
    }
    # Each worker registered the address its pod was given: $(POD_IP) and its own port.
    expected = {
        role: {f"127.0.0.1:{next(iter(p.ports.values()))}" for p in pods[role]}
        for role in ("prefill", "decode", "kvstore")
    }
    listed = wait_for_pools(cluster, expected)
    # `pdserve status` in the gateway's pod has its token: every entry verified.
    assert listed["verified"] and listed["refused"] == {}
    # The registry: Redis asks for the Secret's password, and the workers signed their entries.
    redis_address = cluster.service_address("t-pdserve-redis", "redis")
    host, _, port = redis_address.rpartition(":")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=host, port=int(port), socket_timeout=5).ping()
    password = cluster.secrets["t-pdserve"]["redis-password"]
    registry = redis.Redis(host=host, port=int(port), password=password, socket_timeout=5)
    entries = [json.loads(registry.get(k)) for k in registry.scan_iter(match="pdserve:worker:*")]
    token = cluster.secrets["t-pdserve"]["internal-token"]
    assert len(entries) == 4 and all(
        Verifier.for_tokens(token).why_refused(e) is None for e in entries
    )

    base = "http://" + cluster.service_address("t-pdserve-gateway", "http")
    api_key = cluster.secrets["t-pdserve"]["api-key"]
    assert chat(base, None, "hi").status_code == 401  # the chart's API key is enforced

    reply = chat(base, api_key, "the quick brown fox")
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert isinstance(answer["choices"][0]["message"]["content"], str)
    # Prometheus' path: every pod's metrics port, which a NetworkPolicy opens to the
    # monitoring namespace (the gateways' public REST port serves no /metrics).
    scraped = scrape_every_pod(cluster)
    assert set(scraped) == {p.name for p in cluster.pods if p.component != "redis"}
    assert httpx.get(f"{base}/metrics", timeout=10).status_code == 404
    # Disaggregated: prefilled by the prefill pool, its KV through the kvstore.
    gateway_metrics = next(url for name, url in scraped.items() if "gateway" in name)
    assert metric(gateway_metrics, "pdserve:prefill_requests_total", where="remote") >= 1

    # Both decode replicas serve: requests in flight together spread over the pool.
    replies = asyncio.run(chats(base, api_key, 8))
    assert [r.status_code for r in replies] == [200] * 8
    body = wait_for_pools(cluster, expected)
    served = [w["requests_total"] for w in body["pools"]["decode"]["workers"]]
    assert len(served) == 2 and all(n > 0 for n in served), served

    # A rolling restart of the decode pool (a new pod ready, then an old one drained, twice)
    # while streams run: none fails or ends short, and the registry holds the new pods.
    new, streams = asyncio.run(roll_under_streams(cluster, base, api_key))
    assert len(streams) >= 8 and set(streams) == {(200, "length", 32)}, Counter(streams)
    expected["decode"] = {f"127.0.0.1:{next(iter(p.ports.values()))}" for p in new}
    wait_for_pools(cluster, expected)

    logs = "\n".join(r.child.log_text() for r in cluster.running)
    assert "is not a pdserve setting" not in logs  # every PDSERVE_* the chart sets is read
