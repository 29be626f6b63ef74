"""The shared prefix tier (real processes, tiny Llama, float32): a 2,048-token system prompt
prefilled on one prefill worker is fetched from the kvstore, not computed, by the next
prefill worker that sees it with another question (it computes only the suffix), and by a
fresh worker after the kvstore restarted on the same --disk-path. Every output is
transformers' ``generate``. The kvstores publish what they hold in the registry, where a
gateway's router finds how much of a prompt a prefill worker could fetch."""

from __future__ import annotations

import asyncio
import json
import random
import signal

import pytest

from pdserve.controlplane.view import RegistryView
from pdserve.kv.blocks import LAYOUT_VERSION, BlockLayout
from pdserve.kv.client import KVStoreClient
from pdserve.kv.convert import layout_to_proto
from pdserve.kv.hashing import prompt_block_hashes
from pdserve.local.launcher import free_port
from pdserve.runtime.rpc import aio_channel
from pdserve.testing.metrics import metric
from pdserve.testing.reference import compare, hf_greedy
from pdserve.testing.tiny_models import build_tiny_checkpoint
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc
from tests.helpers.clusters import running
from tests.helpers.flags import engine_flags
from tests.helpers.kv_blocks import decode_call

pytestmark = pytest.mark.timeout(300)

SYSTEM = 2048  # tokens: 128 full blocks of 16
MAX_NEW = 24


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # room for the system prompt (RoPE: no table)
    (path / "config.json").write_text(json.dumps(config))
    rng = random.Random(7)
    system = [rng.randrange(3, 512) for _ in range(SYSTEM)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(n)] for n in (21, 30, 9)]
    return path, hf_greedy(path, prompts, MAX_NEW)


async def _prefill(address: str, request_id: str, prompt: list[int]):
    request = prefill_pb2.PrefillRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=common_pb2.SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
    )
    async with aio_channel(address) as channel:
        answer = await prefill_pb2_grpc.PrefillStub(channel).Prefill(request, timeout=120)
    handed = decode_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=request.params,
        first_token_id=answer.first_token_id,
        block_keys=answer.block_keys,
        kvstore_address=answer.kvstore_address,
        layout=answer.layout,
    )
    return answer, handed


def test_a_prefix_computed_once_is_fetched_not_computed(llama, tmp_path):
    path, refs = llama
    port = free_port()
    disk = ["--disk-path", str(tmp_path / "disk"), "--port", str(port)]
    kvstore = [f"--kvstore=127.0.0.1:{port}"]
    worker = ["--model", str(path), *engine_flags(num_kv_blocks=512), "--metrics-port", "0"]
    ready = ("prefill-metrics",)
    with running(tmp_path / "logs") as cluster:
        store = cluster.start("kvstore", "pdserve.kvstore", *disk)
        p0, p1, decode = cluster.start_many(
            ("prefill-0", "pdserve.prefill", *worker, *kvstore),
            ("prefill-1", "pdserve.prefill", *worker, *kvstore),
            ("decode", "pdserve.decode", *worker, *kvstore),
            ready={"prefill-0": ready, "prefill-1": ready},
        )

        def fetched_blocks(p) -> float:
            url = f"http://{p.addresses['prefill-metrics']}"
            return metric(url, "pdserve:kv_transfer_blocks_total", direction="prefix_fetch")

        def serve(p, request_id: str, ref):
            answer, handed = asyncio.run(_prefill(p.address, request_id, ref.prompt))
            tokens, _ = asyncio.run(decode_call(decode.address, handed))
            assert compare([answer.first_token_id, *tokens], ref) is None
            return answer

        # The first sight of the system prompt computes it (and pushes its blocks).
        assert serve(p0, "first", refs[0]).num_cached_tokens == 0
        assert fetched_blocks(p0) == 0
        # The other prefill worker fetches it: only the question is computed there.
        assert serve(p1, "second", refs[1]).num_cached_tokens == SYSTEM
        assert fetched_blocks(p1) == SYSTEM // 16

        # The kvstore stops (its blocks go to disk) and starts again on the same directory;
        # a fresh prefill worker gets the prefix from the disk tier.
        assert cluster.stop(store, signal.SIGTERM) == 0
        store = cluster.start("kvstore-again", "pdserve.kvstore", *disk)
        p2 = cluster.start("prefill-2", "pdserve.prefill", *worker, *kvstore, ready=ready)
        assert serve(p2, "third", refs[2]).num_cached_tokens == SYSTEM
        assert fetched_blocks(p2) == SYSTEM // 16

        async def stat():
            async with KVStoreClient(store.address) as client:
                return await client.stat(timeout=10)

        assert asyncio.run(stat()).disk_hits >= SYSTEM // 16
        assert cluster.unhandled_errors() == []


def test_kvstores_publish_the_blocks_a_router_credits(redis_server, tmp_path):
    registry = ["--redis-url", redis_server.url, "--redis-prefix", "tier"]
    layout = layout_to_proto(BlockLayout(LAYOUT_VERSION, b"fp", "float32", 16, 2, 2, 8))
    hashes = [bytes(h) for h in prompt_block_hashes(list(range(160)), 16, b"fp")]  # 10

    async def run(address_a: str, address_b: str) -> tuple[int, int]:
        view = RegistryView(redis_server.url, prefix="tier")
        await view.start()
        try:
            blocks = [(h, bytes(1024), 16) for h in hashes]
            async with KVStoreClient(address_a) as a, KVStoreClient(address_b) as b:
                # The first 6 blocks on one replica, the next 2 on the other, none after
                # a gap: 8 leading blocks are fetchable between them.
                await a.put_blocks(layout, blocks[:6], timeout=10)
                await b.put_blocks(layout, blocks[6:8] + blocks[9:], timeout=10)
            for _ in range(100):
                await view.refresh()
                held = await view.fetchable_prefix(hashes)
                if held == 8:
                    break
                await asyncio.sleep(0.1)
            return held, await view.fetchable_prefix(hashes[6:])
        finally:
            await view.close()

    with running(tmp_path) as cluster:
        a, b = (
            cluster.start(name, "pdserve.kvstore", *registry, "--block-lease", "0")
            for name in ("kvstore-a", "kvstore-b")
        )
        held, from_b = asyncio.run(run(a.address, b.address))
    assert (held, from_b) == (8, 2)
