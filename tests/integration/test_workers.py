"""Prefill worker -> kvstore -> decode worker as separate processes on 127.0.0.1, driven over gRPC:
the same tokens as the in-process engine, fewer bytes moved on a repeat, and clear refusals."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.runtime.rpc import aio_channel
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.helpers.clusters import running, start_kvstore
from tests.helpers.flags import ENGINE

MAX_NEW = 16


@pytest.fixture(scope="module")
def cluster(tiny_llama_path, tmp_path_factory):
    with running(tmp_path_factory.mktemp("logs")) as c:
        known = start_kvstore(c)
        model = ["--model", str(tiny_llama_path), *ENGINE]
        c.start_many(
            ("prefill", "pdserve.prefill", *known, *model),
            ("decode", "pdserve.decode", *known, *model),
        )
        yield c


def _prompts():
    rng = random.Random(11)
    return [
        [rng.randrange(3, 512) for _ in range(rng.choice([1, 7, 16, 33, 80, 150]))]
        for _ in range(16)
    ]


async def _generate(cluster, prompt, rid, disaggregate=True):
    params = common_pb2.SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    async with (
        aio_channel(cluster.address("prefill")) as pch,
        aio_channel(cluster.address("decode")) as dch,
    ):
        req = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=params)
        tokens, pre = [], None
        if disaggregate:
            pre = await prefill_pb2_grpc.PrefillStub(pch).Prefill(
                prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params),
                timeout=60,
            )
            req.first_token_id = pre.first_token_id
            tokens.append(pre.first_token_id)  # the decode stream carries the tokens after it
            req.block_keys.extend(pre.block_keys)
            req.kvstore_address = pre.kvstore_address
            req.layout.CopyFrom(pre.layout)
        last = None
        async for out in decode_pb2_grpc.DecodeStub(dch).Decode(req, timeout=120):
            tokens.extend(out.token_ids)
            last = out
        return tokens, (last, pre)


async def _kv_stat(cluster):
    async with aio_channel(cluster.address("kvstore")) as ch:
        return await kvstore_pb2_grpc.KVStoreStub(ch).Stat(kvstore_pb2.StatRequest(), timeout=10)


async def _decode_stat(cluster):
    async with aio_channel(cluster.address("decode")) as ch:
        return await decode_pb2_grpc.DecodeStub(ch).Stat(decode_pb2.DecodeStatRequest(), timeout=10)


def test_16_concurrent_requests_match_the_engine(cluster, tiny_llama_path):
    prompts = _prompts()
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_kv_blocks=256)
    want = [
        o.token_ids
        for o in llm.generate(
            prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
        )
    ]

    async def run(disaggregate):
        return await asyncio.gather(
            *(
                _generate(cluster, p, f"r{disaggregate}-{i}", disaggregate)
                for i, p in enumerate(prompts)
            )
        )

    got = asyncio.run(run(True))
    assert [t for t, _ in got] == want
    colocated = asyncio.run(run(False))
    assert [t for t, _ in colocated] == want
    assert cluster.unhandled_errors() == []


def test_repeat_hits_caches_and_moves_fewer_bytes(cluster):
    prompt = list(range(100, 180))  # 5 full blocks

    async def run():
        before = await _kv_stat(cluster)
        _, first = await _generate(cluster, prompt, "rep-1")
        mid = await _kv_stat(cluster)
        _, second = await _generate(cluster, prompt, "rep-2")
        after = await _kv_stat(cluster)
        return before, first, mid, second, after

    before, (first, pre1), mid, (second, pre2), after = asyncio.run(run())
    assert first.num_transferred_tokens == len(prompt) and first.num_cached_tokens == 0
    # The prefill worker's prefix cache (all but the last block: one token is computed) ...
    assert pre1.num_cached_tokens == 0 and pre2.num_cached_tokens == 64
    # ... and the decode worker's own cache: nothing comes from the kvstore the second time.
    assert second.num_cached_tokens == 80 and second.num_transferred_tokens == 0
    assert after.bytes_out - mid.bytes_out < mid.bytes_out - before.bytes_out


def test_cancel_frees_the_decode_workers_blocks(cluster):
    async def run():
        start = await _decode_stat(cluster)
        params = common_pb2.SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        async with aio_channel(cluster.address("decode")) as ch:
            call = decode_pb2_grpc.DecodeStub(ch).Decode(
                decode_pb2.DecodeRequest(
                    request_id="cancel-me", prompt_token_ids=list(range(5, 60)), params=params
                ),
                timeout=120,
            )
            n = 0
            async for out in call:
                n += len(out.token_ids)
                if n >= 5:
                    call.cancel()
                    break
        for _ in range(100):
            now = await _decode_stat(cluster)
            if now.num_free_blocks == start.num_free_blocks and now.num_running == 0:
                return start, now
            await asyncio.sleep(0.1)
        return start, now

    start, now = asyncio.run(run())
    assert now.num_free_blocks == start.num_free_blocks
    assert cluster.unhandled_errors() == []


def test_bad_requests_get_clear_statuses(cluster):
    async def run():
        async with aio_channel(cluster.address("decode")) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            bad = common_pb2.SamplingParams(max_tokens=4, temperature=-1)
            with pytest.raises(grpc.aio.AioRpcError) as e1:
                async for _ in stub.Decode(
                    decode_pb2.DecodeRequest(request_id="b1", prompt_token_ids=[5], params=bad),
                    timeout=10,
                ):
                    pass
            with pytest.raises(grpc.aio.AioRpcError) as e2:
                async for _ in stub.Decode(
                    decode_pb2.DecodeRequest(
                        request_id="b2", prompt_token_ids=[], params=common_pb2.SamplingParams()
                    ),
                    timeout=10,
                ):
                    pass
            wrong = common_pb2.BlockLayout(
                version=1,
                model_fingerprint=b"x",
                dtype="bfloat16",
                block_size=32,
                num_layers=2,
                num_kv_heads=2,
                head_dim=8,
            )
            with pytest.raises(grpc.aio.AioRpcError) as e3:
                async for _ in stub.Decode(
                    decode_pb2.DecodeRequest(
                        request_id="b3",
                        prompt_token_ids=[5, 6],
                        params=common_pb2.SamplingParams(max_tokens=2),
                        first_token_id=7,
                        layout=wrong,
                    ),
                    timeout=10,
                ):
                    pass
        return e1.value, e2.value, e3.value

    e1, e2, e3 = asyncio.run(run())
    assert e1.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e1.details()
    assert e2.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in e2.details()
    assert e3.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size: ours 16, theirs 32" in e3.details() and "dtype" in e3.details()
