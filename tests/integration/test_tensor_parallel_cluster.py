"""Tensor-parallel workers in a cluster (gloo, tiny Qwen3, float32, eager): a decode worker
at TP 2 beside one at TP 1, behind a prefill worker at TP 1; one rank of the TP-2 worker
SIGKILLed while streams run on it. The worker leaves the registry and exits, its streams
finish on the other worker as transformers' ``generate``, no request fails and no process
is left behind. (``pdserve up`` with other TP sizes per pool: test_up_tensor_parallel.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import redis

from pdserve.testing.cluster import decode_stat
from pdserve.testing.reference import compare, hf_greedy, random_prompts
from pdserve.testing.tiny_models import build_tiny_checkpoint
from tests.helpers.clusters import running, start_kvstore
from tests.helpers.flags import engine_flags
from tests.helpers.streams import stream_greedy
from tests.helpers.up_process import alive

LENGTHS = [1, 40, 70, 130]
MAX_NEW = 160


def followers_of(pid: int) -> list[int]:
    """The tensor-parallel followers a worker started (its children running tp_follower)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"tp_follower" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))
    return path, hf_greedy(path, random_prompts(3, LENGTHS), MAX_NEW)


def test_a_killed_rank_takes_its_worker_out_and_its_streams_move(qwen3, redis_server, tmp_path):
    path, refs = qwen3
    engine = engine_flags(max_num_seqs=8)
    model = ["--model", str(path)]
    registry = ["--redis-url", redis_server.url, "--redis-prefix", "tp", "--registry-ttl", "60"]
    client = redis.Redis.from_url(redis_server.url)
    with running(tmp_path) as cluster:
        known = start_kvstore(cluster)
        prefill, decode0, decode1 = cluster.start_many(
            ("prefill", "pdserve.prefill", *model, *engine, *known),
            ("decode-0", "pdserve.decode", *model, *engine, *known, *registry,
             "--tensor-parallel-size", "2"),
            ("decode-1", "pdserve.decode", *model, *engine, *known, *registry),
        )  # fmt: skip
        (rank1,) = followers_of(decode0.pid)
        entries = [json.loads(client.get(k)) for k in client.keys("tp:worker:*")]
        assert sorted(e.get("tensor_parallel_size", 1) for e in entries) == [1, 2]
        gateway = cluster.start(
            "gateway",
            "pdserve.gateway",
            *("--prefill", prefill.address, "--decode", decode0.address),
            *("--decode", decode1.address, "--routing", "round-robin"),
            *("--served-model-name", "tiny", *model),
        )

        async def run():
            url = f"http://{gateway.addresses['gateway-http']}"
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                started = [asyncio.Event() for _ in refs]
                tasks = [
                    asyncio.create_task(stream_greedy(http, r.prompt, MAX_NEW, e))
                    for r, e in zip(refs, started, strict=True)
                ]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                stat = await decode_stat(decode0.address)
                os.kill(rank1, signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), 180), stat

        got, cut = asyncio.run(run())
        assert cut.num_running + cut.num_waiting >= 1, "no stream was on decode-0 to move"
        ties = [compare(tokens, ref) for tokens, ref in zip(got, refs, strict=True)]
        assert ties.count(None) >= len(refs) - 1, f"too many near-tie differences {ties}"
        assert decode0.proc.wait(timeout=30) == 3  # the watchdog's exit, to be restarted
        deadline = time.monotonic() + 10
        while alive(rank1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(rank1)
        entries = [json.loads(client.get(k)) for k in client.keys("tp:worker:*")]
        assert [e["pid"] for e in entries] == [decode1.pid]  # decode-0 deregistered
        log = decode0.log_text()
        assert "tensor-parallel" in log and "exiting 3" in log
        assert [s for s in cluster.unhandled_errors() if not s.startswith("decode-0")] == []
    client.close()
