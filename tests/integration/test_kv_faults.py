"""A kvstore that fails costs a recompute, never the request: a decode worker whose kvstore
answers INTERNAL, hangs past --kv-fetch-timeout, has lost the blocks or was killed, and a
prefill worker whose push fails the same ways, both real processes over real gRPC. The
request completes, its tokens are transformers' greedy tokens, and the decode worker
recomputed the prompt (nothing transferred) and freed every block."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.kv.client import KVStoreClient
from pdserve.kv.convert import layout_to_proto
from pdserve.local.launcher import free_port
from pdserve.runtime.rpc import aio_channel
from pdserve.testing.cluster import Cluster, decode_idle, decode_stat
from pdserve.testing.metrics import metric
from pdserve.testing.reference import hf_greedy, hf_greedy_tokens
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.helpers.clusters import running
from tests.helpers.flags import engine_flags
from tests.helpers.kv_blocks import decode_call, exported_blocks, fake_kvstore

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 12
PROMPT_LEN = 50  # 3 full blocks of 16 and a tail of 2
FAULTS = ("internal", "hang", "lost", "killed")
HANG_S = 3600.0


class FaultyKVStore(kvstore_pb2_grpc.KVStoreServicer):
    """Every PutBlocks and GetBlocks fails by ``fault``: INTERNAL, a hang, or (``lost``) a
    get that has none of the blocks after a put that stored them all."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.calls: list[str] = []

    async def _fail(self, context: grpc.aio.ServicerContext) -> None:
        if self.fault == "internal":
            await context.abort(grpc.StatusCode.INTERNAL, "injected: the kvstore broke")
        await asyncio.sleep(HANG_S)  # hang: the caller's deadline ends the call

    async def PutBlocks(self, request_iterator, context):
        self.calls.append("put")
        blocks = [b async for r in request_iterator for b in r.blocks]
        if self.fault == "lost":
            return kvstore_pb2.PutBlocksResponse(num_stored=len(blocks))
        await self._fail(context)

    async def GetBlocks(self, request, context) -> AsyncIterator[kvstore_pb2.GetBlocksResponse]:
        self.calls.append("get")
        if self.fault == "lost":
            yield kvstore_pb2.GetBlocksResponse(missing=request.keys)
            return
        await self._fail(context)
        yield kvstore_pb2.GetBlocksResponse()


@contextlib.asynccontextmanager
async def faulty_kvstore(address: str, fault: str) -> AsyncIterator[FaultyKVStore]:
    servicer = FaultyKVStore(fault)
    server = grpc.aio.server()
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    await server.start()
    try:
        yield servicer
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def broken_kvstore(cluster: Cluster, address: str, fault: str, blocks=()):
    """A kvstore on ``address`` that fails by ``fault``; ``killed``: a real kvstore that
    took ``blocks`` and was then SIGKILLed."""
    if fault != "killed":
        async with faulty_kvstore(address, fault) as servicer:
            yield servicer
        return
    port = address.rsplit(":", 1)[1]
    kvstore = cluster.start("kvstore-" + port, "pdserve.kvstore", "--port", port)
    if blocks:
        async with KVStoreClient(address) as client:
            request = kvstore_pb2.PutBlocksRequest(layout=blocks[0].layout, blocks=blocks)
            async with aio_channel(address) as channel:
                await kvstore_pb2_grpc.KVStoreStub(channel).PutBlocks(iter([request]), timeout=10)
            assert (await client.stat(timeout=10)).num_blocks == len(blocks)
    cluster.stop(kvstore, signal.SIGKILL)
    yield None


PROMPTS = {
    (side, fault): [random.Random(f"{side}{fault}").randrange(3, 512) for _ in range(PROMPT_LEN)]
    for side in ("fetch", "push")
    for fault in FAULTS
}


@pytest.fixture(scope="module")
def references(tiny_llama_path) -> dict[tuple[str, str], list[int]]:
    return hf_greedy_tokens(tiny_llama_path, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def cluster(tiny_llama_path, tmp_path_factory):
    """A decode worker that fetches from ``fetch_kvstore`` (or ``sound_kvstore``) within 1 s,
    and a prefill worker that pushes to ``push_kvstore`` within 1 s; no kvstore is up yet."""
    model = ["--model", str(tiny_llama_path), *engine_flags(num_kv_blocks=64)]
    with running(tmp_path_factory.mktemp("kv-faults-logs")) as c:
        c.fetch_kvstore = f"127.0.0.1:{free_port()}"
        c.push_kvstore = f"127.0.0.1:{free_port()}"
        # Never down: the worker's channel to a kvstore it found down backs off before it
        # dials again (a fetch meanwhile fails at once and is recomputed).
        c.sound_kvstore = f"127.0.0.1:{free_port()}"
        c.decode, c.prefill = c.start_many(
            ("decode", "pdserve.decode", *model,
             *("--kvstore", c.fetch_kvstore, "--kvstore", c.sound_kvstore),
             *("--kv-fetch-timeout", "1")),
            ("prefill", "pdserve.prefill", *model,
             *("--kvstore", c.push_kvstore, "--kv-push-timeout", "1")),
            ready={"decode": ("decode-metrics",), "prefill": ("prefill-metrics",)},
        )  # fmt: skip
        yield c


def transfer_failures(worker, direction: str) -> float:
    """The worker's ``pdserve:kv_transfer_failures_total{direction}``, scraped."""
    role = worker.expect[0]
    url = f"http://{worker.addresses[role + '-metrics']}"
    return metric(url, "pdserve:kv_transfer_failures_total", direction=direction)


def params() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


async def check_recomputed(cluster: Cluster, request, want: list[int], first: int) -> None:
    """The decode call's tokens are ``want``, every prompt token was computed there, and
    every block is free again."""
    tokens, last = await decode_call(cluster.decode.address, request)
    assert [first, *tokens] == want
    assert last.finish_reason == "length"
    assert (last.num_transferred_tokens, last.num_cached_tokens) == (0, 0)
    stat = await decode_idle(cluster.decode.address, 10)
    assert stat.num_free_blocks == stat.num_total_blocks
    assert cluster.unhandled_errors() == []


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_failing_fetch_is_recomputed_exactly(cluster, prefill_engine, references, fault):
    prompt, want = PROMPTS["fetch", fault], references["fetch", fault]
    rid = f"fetch-{fault}"
    first, blocks = exported_blocks(prefill_engine, prompt, rid, MAX_NEW)
    request = decode_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        params=params(),
        first_token_id=first,
        block_keys=[b.key for b in blocks],
        kvstore_address=cluster.fetch_kvstore,
        layout=layout_to_proto(prefill_engine.engine.block_layout()),
    )
    failures = (await decode_stat(cluster.decode.address)).kv_fetch_failures
    counted = transfer_failures(cluster.decode, "fetch")
    async with broken_kvstore(cluster, cluster.fetch_kvstore, fault, blocks) as servicer:
        await check_recomputed(cluster, request, want, first)
        if servicer is not None:
            assert servicer.calls == ["get"]
    failures = (await decode_stat(cluster.decode.address)).kv_fetch_failures - failures
    assert failures == (0 if fault == "lost" else 1)
    assert transfer_failures(cluster.decode, "fetch") - counted == failures
    log = cluster.decode.log_text()
    if fault == "lost":
        assert f"request {rid}: fetch" not in log
    else:
        code = {"internal": "INTERNAL", "hang": "DEADLINE_EXCEEDED", "killed": "UNAVAILABLE"}
        assert f"request {rid}: fetch from kvstore {cluster.fetch_kvstore} failed " in log
        assert f"({code[fault]}: " in log and "recomputing its 4 blocks" in log


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_failing_push_still_answers_and_decode_recomputes(cluster, references, fault):
    prompt, want = PROMPTS["push", fault], references["push", fault]
    rid = f"push-{fault}"
    counted = transfer_failures(cluster.prefill, "push")
    async with broken_kvstore(cluster, cluster.push_kvstore, fault) as servicer:
        async with aio_channel(cluster.prefill.address) as channel:
            response = await prefill_pb2_grpc.PrefillStub(channel).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, params=params()
                ),
                timeout=30,
            )
        if servicer is not None:  # the shared prefix tier's lookup, then the push
            assert servicer.calls == ["get", "put"]
    assert response.first_token_id == want[0]
    assert len(response.block_keys) == 4
    failed = transfer_failures(cluster.prefill, "push") - counted
    assert failed == (0 if fault == "lost" else 1)
    log = cluster.prefill.log_text()
    if fault == "lost":  # the push worked: the decode worker finds nothing and recomputes
        assert response.kvstore_address == cluster.push_kvstore
    else:
        assert response.kvstore_address == "" and not response.block_kvstore_addresses
        code = {"internal": "INTERNAL", "hang": "DEADLINE_EXCEEDED", "killed": "UNAVAILABLE"}
        assert f"request {rid}: push to kvstore {cluster.push_kvstore} failed ({code[fault]}" in log
    request = decode_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        params=params(),
        first_token_id=response.first_token_id,
        block_keys=response.block_keys,
        layout=response.layout,
    )
    if fault == "lost":
        # The decode worker knows only its own kvstore: put the lost store there.
        request.kvstore_address = cluster.fetch_kvstore
        async with broken_kvstore(cluster, cluster.fetch_kvstore, "lost"):
            await check_recomputed(cluster, request, want, response.first_token_id)
    else:
        await check_recomputed(cluster, request, want, response.first_token_id)


async def test_blocks_whose_push_failed_are_recomputed_the_rest_imported(
    cluster, prefill_engine, tiny_llama_path
):
    """Replicas split the blocks and the push to one failed: its blocks' addresses are ""."""
    prompt = [random.Random("partial").randrange(3, 512) for _ in range(PROMPT_LEN)]
    (want,) = hf_greedy(tiny_llama_path, [prompt], MAX_NEW)
    first, blocks = exported_blocks(prefill_engine, prompt, "partial", MAX_NEW)
    good = cluster.sound_kvstore
    request = decode_pb2.DecodeRequest(
        request_id="partial",
        prompt_token_ids=prompt,
        params=params(),
        first_token_id=first,
        block_keys=[b.key for b in blocks],
        kvstore_address=good,
        block_kvstore_addresses=[good, good, "", good],
        layout=layout_to_proto(prefill_engine.engine.block_layout()),
    )
    async with fake_kvstore(good) as (servicer, _):
        servicer.blocks = {b.key: b for b in blocks}
        tokens, last = await decode_call(cluster.decode.address, request)
        assert servicer.asked == [blocks[0].key, blocks[1].key, blocks[3].key]
    assert [first, *tokens] == want.tokens
    assert (last.num_transferred_tokens, last.num_cached_tokens) == (32, 0)
    stat = await decode_idle(cluster.decode.address, 10)
    assert stat.num_free_blocks == stat.num_total_blocks
    assert cluster.unhandled_errors() == []
