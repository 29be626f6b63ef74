"""The gateway against fake prefill and decode workers (tests.helpers.fake_workers): real
grpc.aio servers on real sockets, so these tests pin the wire contract the real workers
must keep."""

from __future__ import annotations

import asyncio
from contextlib import aclosing, asynccontextmanager

import grpc
import pytest

from pdserve.core.tokenizer import Tokenizer
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.requests import ModelLimits
from pdserve.gateway.router import Router, RoutingPolicy, StaticPools
from pdserve.gateway.server import GatewayServicer
from pdserve.runtime.rpc import aio_channel
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.helpers.fake_workers import (
    ANSWER,
    LAYOUT,
    FakeDecode,
    FakePrefill,
    answer_workers,
    orchestrating,
    prefill_response,
    serving,
)

# Every wait on the fakes is bounded by this. The events come in milliseconds; the bound
# only has to hold on a loaded machine (the suite's other process takes the other core).
WAIT_S = 10.0
PARAMS = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)


async def collect(orchestrator: Orchestrator, prompt=(5, 6, 7), params=PARAMS) -> list:
    async with asyncio.timeout(WAIT_S):
        return [e async for e in orchestrator.generate("r1", list(prompt), params)]


# -- orchestrator ---------------------------------------------------------------------------


async def test_prefill_then_decode_hands_over_the_prefill_fields():
    log: list = []
    prefill = FakePrefill(log, prefill_response(first_token_id=100))
    decode = FakeDecode(log, [[101, 102], [103]], num_cached_tokens=32)
    async with serving(prefill, decode) as (p, d), orchestrating([p], [d]) as orchestrator:
        events = await collect(orchestrator)

    assert [kind for kind, _ in log] == ["prefill", "decode"]
    prefill_request, decode_request = log[0][1], log[1][1]
    assert prefill_request.request_id == decode_request.request_id == "r1"
    assert list(prefill_request.prompt_token_ids) == list(decode_request.prompt_token_ids)
    assert prefill_request.params == decode_request.params == PARAMS
    assert decode_request.HasField("first_token_id") and decode_request.first_token_id == 100
    assert decode_request.first_logprob == prefill.response.first_logprob
    assert list(decode_request.block_keys) == [b"hash-0", b"hash-1", b"tail/r1"]
    assert decode_request.kvstore_address == "127.0.0.1:7777"
    assert decode_request.layout == LAYOUT

    # The first token once, from the prefill; the decode stream carries the rest.
    assert [list(e.token_ids) for e in events] == [[100], [101, 102], [103]]
    assert [e.num_cached_tokens for e in events] == [16, 32, 32]
    assert [[lp.logprob for lp in e.logprobs] for e in events] == [[-0.25], [-0.5, -0.5], [-0.5]]
    assert [e.finish_reason for e in events] == ["", "", "length"]


async def test_a_finished_prefill_skips_decode():
    log: list = []
    prefill = FakePrefill(log, prefill_response(first_token_id=2, finish_reason="stop"))
    decode = FakeDecode(log, [[1]])
    async with serving(prefill, decode) as (p, d), orchestrating([p], [d]) as orchestrator:
        events = await collect(orchestrator)
    assert [kind for kind, _ in log] == ["prefill"]
    assert [(list(e.token_ids), e.finish_reason) for e in events] == [([2], "stop")]


async def test_colocated_mode_skips_prefill():
    log: list = []
    decode = FakeDecode(log, [[11], [12]], finish_reason="stop")
    async with serving(decode) as (d,), orchestrating([], [d], disaggregation=False) as orch:
        events = await collect(orch)
    assert [kind for kind, _ in log] == ["decode"]
    request = log[0][1]
    assert not request.HasField("first_token_id") and not request.HasField("first_logprob")
    assert list(request.block_keys) == [] and request.kvstore_address == ""
    assert [list(e.token_ids) for e in events] == [[11], [12]]


async def test_decode_workers_are_picked_round_robin():
    logs: list[list] = [[], []]
    fakes = [FakeDecode(logs[0], [[1]]), FakeDecode(logs[1], [[1]])]
    async with serving(*fakes) as addrs, orchestrating([], addrs, disaggregation=False) as orch:
        for _ in range(4):
            await collect(orch)
    assert [len(log) for log in logs] == [2, 2]
    router = Router(StaticPools(["p1", "p2"], ["d1"]), RoutingPolicy("round-robin"))
    picks = [(await router.pick("prefill", [1, 2, 3])).address for _ in range(3)]
    assert picks == ["p1", "p2", "p1"]


async def test_closing_the_stream_cancels_the_decode_call():
    log: list = []
    decode = FakeDecode(log, [[i] for i in range(1000)], delay_s=0.05)
    async with serving(decode) as (d,), orchestrating([], [d], disaggregation=False) as orch:
        async with aclosing(orch.generate("r1", [5], PARAMS)) as events:
            async with asyncio.timeout(WAIT_S):
                assert list((await anext(events)).token_ids) == [0]
        await asyncio.wait_for(decode.cancelled.wait(), WAIT_S)


async def test_cancelling_the_consumer_cancels_the_decode_call():
    log: list = []
    prefill = FakePrefill(log, prefill_response(first_token_id=100))
    decode = FakeDecode(log, [[i] for i in range(1000)], delay_s=0.05)
    got_tokens = asyncio.Event()

    async def consume(orchestrator):
        async for event in orchestrator.generate("r1", [5], PARAMS):
            if len(event.token_ids) and event.token_ids[0] != 100:
                got_tokens.set()

    async with serving(prefill, decode) as (p, d), orchestrating([p], [d]) as orchestrator:
        task = asyncio.create_task(consume(orchestrator))
        await asyncio.wait_for(got_tokens.wait(), WAIT_S)
        task.cancel()
        await asyncio.wait_for(decode.cancelled.wait(), WAIT_S)
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_worker_error_comes_through_as_is():
    log: list = []
    decode = FakeDecode(log, [], error=(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks"))
    async with serving(decode) as (d,), orchestrating([], [d], disaggregation=False) as orch:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await collect(orch)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raised.value.details() == "no free KV blocks"


# -- the gateway servicer over a real socket ------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return Tokenizer.from_dir(smollm2_path)


@asynccontextmanager
async def gateway(tokenizer, prefill: FakePrefill, decode: FakeDecode, max_model_len=64):
    async with (
        serving(prefill, decode) as (p, d),
        orchestrating([p], [d]) as orchestrator,
        serving(GatewayServicer(orchestrator, tokenizer, ModelLimits(max_model_len, 49152))) as (
            g,
        ),
    ):
        channel = aio_channel(g)
        try:
            yield gateway_pb2_grpc.GatewayStub(channel)
        finally:
            await channel.close()


async def test_stream_applies_a_stop_string_and_cancels_upstream(tokenizer):
    log, prefill, decode = answer_workers(tokenizer, delay_s=0.05)
    request = gateway_pb2.GenerateRequest(
        prompt="What is the capital of Japan?", params=PARAMS, stop=["STOP"]
    )
    async with gateway(tokenizer, prefill, decode) as stub:
        messages = [m async for m in stub.GenerateStream(request, timeout=10)]
        await asyncio.wait_for(decode.cancelled.wait(), WAIT_S)

    assert "".join(m.text for m in messages) == " The capital of Japan is Tokyo 東京. "
    assert all(m.finish_reason == "" for m in messages[:-1])
    last = messages[-1]
    assert last.finish_reason == "stop"
    prompt_ids = tokenizer.encode("What is the capital of Japan?", add_special_tokens=True)
    assert list(log[0][1].prompt_token_ids) == prompt_ids
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert last.usage.completion_tokens == sum(len(m.token_ids) for m in messages)
    assert last.usage.cached_prompt_tokens == 32  # the larger of prefill's 16 and decode's 32
    assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
    assert len({m.request_id for m in messages}) == 1 and messages[0].request_id


async def test_unary_returns_all_tokens_and_text(tokenizer):
    log, prefill, decode = answer_workers(tokenizer)
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    request = gateway_pb2.GenerateRequest(
        request_id="mine",
        prompt_token_ids=gateway_pb2.TokenIds(ids=[1, 2, 3]),
        params=common_pb2.SamplingParams(),  # all proto3 defaults
    )
    async with gateway(tokenizer, prefill, decode) as stub:
        response = await stub.Generate(request, timeout=10)

    assert response.request_id == "mine"
    assert list(response.token_ids) == ids
    assert response.text == ANSWER
    assert response.finish_reason == "length"
    assert len(response.logprobs) == 0  # not asked for
    assert response.usage == common_pb2.Usage(
        prompt_tokens=3, completion_tokens=len(ids), cached_prompt_tokens=32
    )
    # Unset proto3 values reach the workers resolved; an unset max_tokens is the default
    # (256) or, as here, what room the context leaves (64 - 3 prompt tokens).
    sent = log[0][1].params
    assert (sent.max_tokens, sent.top_p, sent.top_k, sent.temperature) == (61, 1.0, -1, 0.0)
    assert not sent.HasField("seed") and not sent.HasField("logprobs")


async def test_chat_messages_use_the_template(tokenizer, smollm2_path):
    log, prefill, decode = answer_workers(tokenizer)
    chat = [{"role": "user", "content": "Hi!"}]
    request = gateway_pb2.GenerateRequest(
        messages=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in chat])
    )
    async with gateway(tokenizer, prefill, decode) as stub:
        await stub.Generate(request, timeout=10)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_path)
    expected = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert list(log[0][1].prompt_token_ids) == list(expected["input_ids"])


@pytest.mark.parametrize(
    "request_kwargs, message_parts",
    [
        (dict(prompt=""), ["empty"]),
        (dict(prompt_token_ids=gateway_pb2.TokenIds(ids=[])), ["empty"]),
        (dict(), ["prompt"]),
        (dict(prompt_token_ids=gateway_pb2.TokenIds(ids=[1, 99999])), ["99999", "49152"]),
        (dict(prompt_token_ids=gateway_pb2.TokenIds(ids=list(range(70)))), ["70", "64"]),
        (
            dict(prompt="hi", params=common_pb2.SamplingParams(temperature=-1.0)),
            ["temperature must be in [0, 100]"],
        ),
        (dict(prompt="hi", params=common_pb2.SamplingParams(top_p=1.5)), ["top_p"]),
        (dict(prompt="hi", params=common_pb2.SamplingParams(top_p=-0.5)), ["top_p"]),
        (dict(prompt="hi", params=common_pb2.SamplingParams(top_k=-5)), ["top_k"]),
        (dict(prompt="hi", params=common_pb2.SamplingParams(min_tokens=300)), ["min_tokens"]),
        (dict(prompt="hi", params=common_pb2.SamplingParams(logprobs=21)), ["logprobs"]),
    ],
)
async def test_bad_requests_are_invalid_argument(tokenizer, request_kwargs, message_parts):
    log, prefill, decode = answer_workers(tokenizer)
    request = gateway_pb2.GenerateRequest(**request_kwargs)
    async with gateway(tokenizer, prefill, decode) as stub:
        errors = []
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Generate(request, timeout=10)
        errors.append(raised.value)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [m async for m in stub.GenerateStream(request, timeout=10)]
        errors.append(raised.value)
    for error in errors:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert all(part in error.details() for part in message_parts), error.details()
    assert log == []  # no worker was called


async def test_client_cancel_reaches_the_decode_worker(tokenizer):
    log, prefill, decode = answer_workers(tokenizer, delay_s=0.2)
    request = gateway_pb2.GenerateRequest(prompt="Hello", params=PARAMS)
    async with gateway(tokenizer, prefill, decode) as stub:
        call = stub.GenerateStream(request, timeout=10)
        async with asyncio.timeout(WAIT_S):
            await call.read()  # the first token, from prefill
            await call.read()  # the first chunk from decode
        call.cancel()
        await asyncio.wait_for(decode.cancelled.wait(), WAIT_S)


async def test_worker_errors_keep_their_status(tokenizer):
    log: list = []
    prefill = FakePrefill(log, prefill_response(first_token_id=100))
    decode = FakeDecode(log, [], error=(grpc.StatusCode.FAILED_PRECONDITION, "layout mismatch"))
    request = gateway_pb2.GenerateRequest(prompt="Hello")
    async with gateway(tokenizer, prefill, decode) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Generate(request, timeout=10)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert raised.value.details() == "layout mismatch"
