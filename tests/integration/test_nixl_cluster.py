"""KV over NIXL in a cluster of real processes (Redis, a kvstore, a prefill worker, two
decode workers, a gateway; tiny Llama, float32): every prompt's blocks are read straight
from the prefill worker's memory, the output is transformers' ``generate``, a decode
worker SIGKILLed mid-stream loses no stream, and a prefill worker SIGKILLed between its
answer and the decode worker's read costs a fallback (kvstore or recompute), never the
request. Without the registry, ``auto`` runs on gRPC and says so once; ``nixl`` refuses
to start. Skipped where NIXL is not installed (`pdserve[nixl]`)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys

import httpx
import pytest

from pdserve.runtime.rpc import aio_channel
from pdserve.testing.cluster import decode_idle
from pdserve.testing.metrics import metric
from pdserve.testing.reference import compare, hf_greedy, random_prompts
from pdserve.testing.tiny_models import build_tiny_checkpoint
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc
from tests.helpers.clusters import running, start_kvstore
from tests.helpers.flags import engine_flags
from tests.helpers.kv_blocks import decode_call
from tests.helpers.streams import stream_greedy

# Not imported here: NIXL's libraries in a pytest process break a later protoc load there.
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        importlib.util.find_spec("nixl") is None, reason="NIXL is not installed (pdserve[nixl])"
    ),
]

LENGTHS = [5, 40, 70, 130]
MAX_NEW = 96


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    return path, hf_greedy(path, random_prompts(40, LENGTHS), MAX_NEW)


def _blocks(n: int) -> int:
    return -(-n // 16)


def test_blocks_go_over_nixl_exactly_and_survive_faults(llama, redis_server, tmp_path):
    path, refs = llama
    model = ["--model", str(path)]
    registry = ["--redis-url", redis_server.url, "--redis-prefix", "nx"]
    nixl = ["--kv-transport", "nixl", "--nixl-buffer-bytes", "16MiB"]
    engine = engine_flags(max_num_seqs=8)
    metrics = ["--metrics-port", "0"]
    with running(tmp_path) as cluster:
        start_kvstore(cluster, *registry)
        prefill, decode0, decode1 = cluster.start_many(
            ("prefill", "pdserve.prefill", *model, *engine, *registry, *nixl),
            ("decode-0", "pdserve.decode", *model, *engine, *registry, *nixl, *metrics),
            ("decode-1", "pdserve.decode", *model, *engine, *registry, *nixl, *metrics),
            ready={"decode-0": ("decode-metrics",), "decode-1": ("decode-metrics",)},
        )
        gateway = cluster.start(
            "gateway",
            "pdserve.gateway",
            *registry,
            *("--routing", "round-robin", "--local-prefill-threshold", "0"),
            *("--served-model-name", "tiny", *model),
        )
        url = f"http://{gateway.addresses['gateway-http']}"

        def read(kind: str, direction: str = "nixl_read") -> float:
            return sum(
                metric(
                    f"http://{d.addresses['decode-metrics']}",
                    f"pdserve:kv_transfer_{kind}_total",
                    direction=direction,
                )
                for d in (decode0, decode1)
                if d.proc.poll() is None
            )

        async def streams(kill: int | None):
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                started = [asyncio.Event() for _ in refs]
                tasks = [
                    asyncio.create_task(stream_greedy(http, r.prompt, MAX_NEW, e))
                    for r, e in zip(refs, started, strict=True)
                ]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                if kill is not None:
                    os.kill(kill, signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), 180)

        # 1. Every prompt's blocks over NIXL, the output transformers'.
        got = asyncio.run(streams(None))
        ties = [compare(tokens, ref) for tokens, ref in zip(got, refs, strict=True)]
        assert ties.count(None) >= len(refs) - 1, f"too many near-tie differences {ties}"
        read_blocks = read("blocks")
        assert read_blocks == sum(_blocks(len(r.prompt)) for r in refs)
        assert read("blocks", "fetch") == 0  # nothing from the kvstore
        assert "KV transport nixl" in prefill.log_text()

        # 2. A prefill worker SIGKILLed between its answer and the decode worker's read.
        ref = refs[2]
        request = prefill_pb2.PrefillRequest(
            request_id="killed-prefill",
            prompt_token_ids=ref.prompt,
            params=common_pb2.SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
            decode_reads_nixl=True,
        )

        async def prefill_call() -> prefill_pb2.PrefillResponse:
            async with aio_channel(prefill.address) as channel:
                return await prefill_pb2_grpc.PrefillStub(channel).Prefill(request, timeout=60)

        answer = asyncio.run(prefill_call())
        assert answer.HasField("nixl") and len(answer.nixl.addresses) == _blocks(len(ref.prompt))
        os.kill(prefill.pid, signal.SIGKILL)
        prefill.proc.wait(timeout=10)
        handed = decode_pb2.DecodeRequest(
            request_id=request.request_id,
            prompt_token_ids=ref.prompt,
            params=request.params,
            first_token_id=answer.first_token_id,
            block_keys=answer.block_keys,
            kvstore_address=answer.kvstore_address,
            layout=answer.layout,
            block_kvstore_addresses=answer.block_kvstore_addresses,
            nixl=answer.nixl,
        )
        before = read("failures")
        tokens, last = asyncio.run(decode_call(decode1.address, handed))
        assert compare([answer.first_token_id, *tokens], ref) is None
        assert read("failures") == before + 1  # the read failed, then fell back
        assert "NIXL read of" in decode1.log_text()

        # 3. A decode worker SIGKILLed mid-stream: its streams move (to a worker that
        # prefills them itself, the prefill worker being gone) and stay exact.
        got = asyncio.run(streams(decode0.pid))
        ties = [compare(tokens, ref) for tokens, ref in zip(got, refs, strict=True)]
        assert ties.count(None) >= len(refs) - 1, f"too many near-tie differences {ties}"
        asyncio.run(decode_idle(decode1.address, 30, blocks_free=True))
        errors = [
            s for s in cluster.unhandled_errors() if not s.startswith(("prefill", "decode-0"))
        ]
        assert errors == []


def test_without_a_registry_auto_says_grpc_once_and_nixl_refuses(tmp_path):
    path = build_tiny_checkpoint("llama", tmp_path / "llama")
    base = [sys.executable, "-m", "pdserve.cli", "decode", "--model", str(path), "--port", "0"]
    refused = subprocess.run(
        [*base, "--kv-transport", "nixl", *engine_flags()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2, refused.stderr
    assert "--kv-transport nixl" in refused.stderr and "--redis-url" in refused.stderr
    with running(tmp_path / "logs") as cluster:
        decode = cluster.start("decode", "pdserve.decode", "--model", str(path), *engine_flags())
        log = decode.log_text()
        assert log.count("KV transport grpc") == 1, log
        assert "--redis-url is not set" in log
