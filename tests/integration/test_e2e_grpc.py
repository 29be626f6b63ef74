"""The whole disaggregated path through the gateway's gRPC API, every service its own process:
gateway -> prefill worker -> kvstore -> decode worker, and the colocated alternative."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.runtime.rpc import aio_channel
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.helpers.clusters import running, start_kvstore
from tests.helpers.flags import COMPILED, engine_flags

MAX_NEW = 12


@pytest.fixture(scope="module")
def cluster(tiny_llama_path, tmp_path_factory):
    model = ["--model", str(tiny_llama_path)]
    # decode-bs32 has another block size and dtype: it must refuse the prefill worker's blocks.
    odd = engine_flags(block_size=32, dtype="bfloat16")
    with running(tmp_path_factory.mktemp("e2e-logs")) as c:
        known = start_kvstore(c)
        pre, dec, odd = c.start_many(
            # The workers' default step, compiled: served exactly as the engine.
            ("prefill", "pdserve.prefill", *known, *model, *COMPILED),
            ("decode", "pdserve.decode", *known, *model, *COMPILED),
            ("decode-bs32", "pdserve.decode", *known, *model, *odd),
        )
        c.start_many(
            ("gateway", "pdserve.gateway", "--prefill", pre.address, "--decode", dec.address, *model),
            ("gateway-colocated", "pdserve.gateway", "--decode", dec.address,
             "--disaggregation", "off", *model),
            ("gateway-mismatch", "pdserve.gateway", "--prefill", pre.address,
             "--decode", odd.address, *model),
        )  # fmt: skip
        yield c


def _prompts():
    rng = random.Random(5)
    return [
        [rng.randrange(3, 512) for _ in range(rng.choice([1, 9, 16, 40, 100, 170]))]
        for _ in range(16)
    ]


def _request(prompt, rid, max_tokens=MAX_NEW):
    return gateway_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=gateway_pb2.TokenIds(ids=prompt),
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )


async def _stream(address, req):
    async with aio_channel(address) as ch:
        tokens, last = [], None
        async for out in gateway_pb2_grpc.GatewayStub(ch).GenerateStream(req, timeout=120):
            tokens.extend(out.token_ids)
            last = out
        return tokens, last


async def _unary(address, req):
    async with aio_channel(address) as ch:
        return await gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=120)


@pytest.fixture(scope="module")
def expected(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_kv_blocks=256, enforce_eager=True)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(_prompts(), params)]


@pytest.mark.parametrize("gateway", ["gateway", "gateway-colocated"])
def test_16_concurrent_requests_equal_the_engine(cluster, expected, gateway):
    address = cluster.address(gateway)
    prompts = _prompts()

    async def run():
        streamed = await asyncio.gather(
            *(_stream(address, _request(p, f"{gateway}-s{i}")) for i, p in enumerate(prompts))
        )
        unary = await asyncio.gather(
            *(_unary(address, _request(p, f"{gateway}-u{i}")) for i, p in enumerate(prompts))
        )
        return streamed, unary

    streamed, unary = asyncio.run(run())
    assert [t for t, _ in streamed] == expected
    assert [list(u.token_ids) for u in unary] == expected
    for (_, last), u, p in zip(streamed, unary, prompts, strict=True):
        assert last.finish_reason == "length" and u.finish_reason == "length"
        assert u.usage.prompt_tokens == len(p) and u.usage.completion_tokens == MAX_NEW
    assert cluster.unhandled_errors() == []


def test_cancel_through_the_gateway_frees_decode_blocks(cluster):
    async def decode_stat():
        async with aio_channel(cluster.address("decode")) as ch:
            return await decode_pb2_grpc.DecodeStub(ch).Stat(
                decode_pb2.DecodeStatRequest(), timeout=10
            )

    async def run():
        start = await decode_stat()
        async with aio_channel(cluster.address("gateway")) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).GenerateStream(
                _request(list(range(10, 90)), "cancel-1", max_tokens=400), timeout=120
            )
            got = 0
            async for out in call:
                got += len(out.token_ids)
                if got >= 4:
                    call.cancel()
                    break
        for _ in range(100):
            now = await decode_stat()
            if now.num_running == 0 and now.num_free_blocks == start.num_free_blocks:
                break
            await asyncio.sleep(0.1)
        return start, now

    start, now = asyncio.run(run())
    assert now.num_running == 0
    assert now.num_free_blocks == start.num_free_blocks
    assert cluster.unhandled_errors() == []


def test_layout_mismatch_reaches_the_client(cluster):
    async def run():
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(
                _unary(cluster.address("gateway-mismatch"), _request([5, 6, 7], "mm-1")), 60
            )
        return e.value

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size: ours 32, theirs 16" in err.details()
    assert "dtype: ours bfloat16, theirs float32" in err.details()
