"""Block lifetimes through real processes: a prefill worker pushes a prompt's blocks to a
kvstore with a 2 s lease. A decode worker that fetches them leaves the full (prefix) blocks
in the kvstore for good and has the tail dropped; blocks no decode worker fetched expire."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pdserve.kv.client import KVStoreClient
from pdserve.runtime.rpc import aio_channel
from pdserve.testing.cluster import Cluster, decode_idle
from pdserve.testing.reference import hf_greedy
from pdserve.v1 import common_pb2, decode_pb2, kvstore_pb2, prefill_pb2, prefill_pb2_grpc
from tests.helpers.clusters import running
from tests.helpers.flags import engine_flags
from tests.helpers.kv_blocks import decode_call

pytestmark = pytest.mark.timeout(300)

# Long enough that the decode call right after the prefill fetches before it ends.
LEASE_S = 2.0
MAX_NEW = 8
PROMPT_LEN = 50  # 3 full blocks of 16 and a tail of 2
RNG = random.Random(15)
FETCHED, ABANDONED = ([RNG.randrange(3, 512) for _ in range(PROMPT_LEN)] for _ in range(2))


@pytest.fixture(scope="module")
def cluster(tiny_llama_path, tmp_path_factory):
    model = ["--model", str(tiny_llama_path), *engine_flags(num_kv_blocks=64)]
    with running(tmp_path_factory.mktemp("block-lease-logs")) as c:
        kvstore = c.start("kvstore", "pdserve.kvstore", "--block-lease", str(LEASE_S))
        c.prefill, c.decode = c.start_many(
            ("prefill", "pdserve.prefill", *model, "--kvstore", kvstore.address),
            ("decode", "pdserve.decode", *model, "--kvstore", kvstore.address),
        )
        c.kvstore = kvstore
        yield c


def params() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


async def prefill(cluster: Cluster, rid: str, prompt: list[int]) -> prefill_pb2.PrefillResponse:
    async with aio_channel(cluster.prefill.address) as channel:
        return await prefill_pb2_grpc.PrefillStub(channel).Prefill(
            prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params()),
            timeout=30,
        )


async def stat_until(cluster: Cluster, done, within_s: float) -> kvstore_pb2.StatResponse:
    deadline = time.monotonic() + within_s
    async with KVStoreClient(cluster.kvstore.address) as client:
        while True:
            stat = await client.stat(timeout=10)
            if done(stat):
                return stat
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {within_s} s: {stat}")
            await asyncio.sleep(0.05)


async def kvstore_stat(cluster: Cluster) -> kvstore_pb2.StatResponse:
    return await stat_until(cluster, lambda s: True, 10)


async def test_fetched_prefix_blocks_stay_the_tail_is_dropped(cluster, tiny_llama_path):
    (want,) = hf_greedy(tiny_llama_path, [FETCHED], MAX_NEW)
    before = await kvstore_stat(cluster)
    response = await prefill(cluster, "fetched", FETCHED)
    assert len(response.block_keys) == 4 and response.kvstore_address
    pushed = await kvstore_stat(cluster)
    assert pushed.num_leased - before.num_leased == 4

    request = decode_pb2.DecodeRequest(
        request_id="fetched",
        prompt_token_ids=FETCHED,
        params=params(),
        first_token_id=response.first_token_id,
        block_keys=response.block_keys,
        kvstore_address=response.kvstore_address,
        layout=response.layout,
    )
    tokens, last = await decode_call(cluster.decode.address, request)
    assert [response.first_token_id, *tokens] == want.tokens
    assert last.num_transferred_tokens == PROMPT_LEN
    fetched = await kvstore_stat(cluster)
    assert fetched.dropped - before.dropped == 1
    assert fetched.num_leased == before.num_leased
    assert fetched.num_blocks - before.num_blocks == 3

    # Two leases later the prefix blocks are still there: no lease holds them now.
    await asyncio.sleep(2 * LEASE_S)
    later = await kvstore_stat(cluster)
    assert (later.num_blocks, later.expired) == (fetched.num_blocks, fetched.expired)
    stat = await decode_idle(cluster.decode.address, 10)
    assert stat.num_free_blocks == stat.num_total_blocks
    assert cluster.unhandled_errors() == []


async def test_blocks_no_decode_worker_fetched_expire(cluster):
    before = await kvstore_stat(cluster)
    response = await prefill(cluster, "abandoned", ABANDONED)
    assert len(response.block_keys) == 4
    # Gone within 1.25 leases; the deadline leaves room for a loaded machine.
    after = await stat_until(cluster, lambda s: s.expired == before.expired + 4, 10 * LEASE_S)
    assert (after.num_blocks, after.num_leased) == (before.num_blocks, before.num_leased)
    assert after.bytes_used == before.bytes_used
    assert cluster.unhandled_errors() == []
