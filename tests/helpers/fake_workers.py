"""Fake prefill and decode workers: real grpc.aio servers on 127.0.0.1 that return fixed
token streams and record what they were sent and whether their call was cancelled, so that
tests pin the wire contract the real workers must keep."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from pdserve.core.tokenizer import Tokenizer
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.server import SERVICE_NAME
from pdserve.runtime.rpc import start_server
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

LAYOUT = common_pb2.BlockLayout(
    version=1,
    model_fingerprint=b"\x01" * 16,
    dtype="float32",
    block_size=16,
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    """Answers every Prefill with one fixed response."""

    def __init__(self, log: list, response: prefill_pb2.PrefillResponse) -> None:
        self.log = log
        self.response = response

    async def Prefill(self, request, context):
        self.log.append(("prefill", request))
        return self.response


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    """Streams fixed token chunks, the last one with finish_reason; notes a cancellation.

    Like the real worker, a stream after a prefill carries only the tokens after the
    prefill's first token.
    """

    def __init__(
        self,
        log: list,
        chunks: list[list[int]],
        finish_reason: str = "length",
        delay_s: float = 0.0,
        num_cached_tokens: int = 0,
        error: tuple[grpc.StatusCode, str] | None = None,
    ) -> None:
        self.log = log
        self.chunks = chunks
        self.finish_reason = finish_reason
        self.delay_s = delay_s
        self.num_cached_tokens = num_cached_tokens
        self.error = error
        self.started = asyncio.Event()  # a Decode call arrived
        self.cancelled = asyncio.Event()

    async def Decode(self, request, context):
        self.log.append(("decode", request))
        self.started.set()
        # A cancellation that comes while grpc writes a response (outside this generator)
        # closes the generator later, or never raises in it: the RPC's end tells at once.
        context.add_done_callback(lambda ctx: ctx.cancelled() and self.cancelled.set())
        if self.error is not None:
            await context.abort(*self.error)
        chunks = self.chunks
        try:
            for i, ids in enumerate(chunks):
                last = i == len(chunks) - 1
                yield decode_pb2.DecodeResponse(
                    token_ids=ids,
                    logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=-0.5) for t in ids],
                    finish_reason=self.finish_reason if last else "",
                    num_cached_tokens=self.num_cached_tokens,
                )
                await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            if context.cancelled():
                self.cancelled.set()


def prefill_response(first_token_id: int, finish_reason: str = "") -> prefill_pb2.PrefillResponse:
    """A prefill's answer: its first token, three block keys in a kvstore, LAYOUT."""
    return prefill_pb2.PrefillResponse(
        first_token_id=first_token_id,
        first_logprob=common_pb2.TokenLogprob(token_id=first_token_id, logprob=-0.25),
        block_keys=[b"hash-0", b"hash-1", b"tail/r1"],
        num_prompt_tokens=40,
        num_cached_tokens=16,
        kvstore_address="127.0.0.1:7777",
        layout=LAYOUT,
        finish_reason=finish_reason,
    )


@asynccontextmanager
async def serving(*servicers: object) -> AsyncIterator[list[str]]:
    """Each fake (or a gateway servicer) on its own 127.0.0.1 port; yields the addresses."""
    servers, addresses = [], []
    for servicer in servicers:
        if isinstance(servicer, FakePrefill):
            add, name = prefill_pb2_grpc.add_PrefillServicer_to_server, "pdserve.v1.Prefill"
        elif isinstance(servicer, FakeDecode):
            add, name = decode_pb2_grpc.add_DecodeServicer_to_server, "pdserve.v1.Decode"
        else:
            add, name = gateway_pb2_grpc.add_GatewayServicer_to_server, SERVICE_NAME
        server, port = await start_server(
            "127.0.0.1:0", [lambda s, add=add, sv=servicer: add(sv, s)], [name]
        )
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    try:
        yield addresses
    finally:
        await asyncio.gather(*(s.stop(grace=None) for s in servers))


@asynccontextmanager
async def orchestrating(
    prefill_addrs: list[str], decode_addrs: list[str], disaggregation: bool = True
) -> AsyncIterator[Orchestrator]:
    """A gateway's orchestrator over these workers, with 5 s deadlines; closed at the end."""
    orchestrator = Orchestrator.with_addresses(
        prefill_addrs, decode_addrs, disaggregation, prefill_timeout_s=5, decode_timeout_s=5
    )
    try:
        yield orchestrator
    finally:
        await orchestrator.close()


ANSWER = " The capital of Japan is Tokyo 東京. STOP Then it rambles on"


def answer_workers(
    tokenizer: Tokenizer, delay_s: float = 0.0
) -> tuple[list, FakePrefill, FakeDecode]:
    """Fakes that stream ANSWER's tokens: the first from prefill, the rest two by two."""
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    log: list = []
    prefill = FakePrefill(log, prefill_response(first_token_id=ids[0]))
    chunks = [ids[i : i + 2] for i in range(1, len(ids), 2)]
    return log, prefill, FakeDecode(log, chunks, delay_s=delay_s, num_cached_tokens=32)
