"""A prompt's KV blocks as a prefill worker exports them, a fake kvstore (a real gRPC server)
that serves whatever Block messages it is given, spoiled or not, and the decode call that
imports them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from pdserve.engine import LLM, SamplingParams
from pdserve.kv.blocks import block_checksum
from pdserve.kv.convert import layout_to_proto
from pdserve.runtime.rpc import aio_channel
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

DECODE_TIMEOUT_S = 60.0


def exported_blocks(
    llm: LLM, prompt: list[int], rid: str, max_tokens: int
) -> tuple[int, list[common_pb2.Block]]:
    """The first token and the Block messages a prefill worker would have put."""
    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seq = eng.add_request(prompt, params, rid, prefill_only=True)
    while eng.has_unfinished():
        eng.step()
    layout = layout_to_proto(eng.block_layout())
    blocks = [
        common_pb2.Block(
            key=b.key,
            data=bytes(b.data),
            num_tokens=b.num_tokens,
            layout=layout,
            checksum=block_checksum(b.key, b.num_tokens, b.data),
        )
        for b in eng.export_prompt_blocks(rid)
    ]
    return seq.output_token_ids[0], blocks


async def decode_call(address: str, request: decode_pb2.DecodeRequest) -> tuple[list[int], object]:
    """A Decode call to the worker at ``address``: the tokens it streamed and its last
    message."""
    async with aio_channel(address) as channel:
        tokens, last = [], None
        async for out in decode_pb2_grpc.DecodeStub(channel).Decode(
            request, timeout=DECODE_TIMEOUT_S
        ):
            tokens.extend(out.token_ids)
            last = out
        return tokens, last


class FakeKVStore(kvstore_pb2_grpc.KVStoreServicer):
    """GetBlocks of the Block messages it was given, as they are."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, common_pb2.Block] = {}
        self.asked: list[bytes] = []

    async def GetBlocks(
        self, request: kvstore_pb2.GetBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.GetBlocksResponse]:
        self.asked.extend(request.keys)
        yield kvstore_pb2.GetBlocksResponse(
            blocks=[self.blocks[k] for k in request.keys if k in self.blocks],
            missing=[k for k in request.keys if k not in self.blocks],
        )


@contextlib.asynccontextmanager
async def fake_kvstore(address: str) -> AsyncIterator[tuple[FakeKVStore, str]]:
    """The fake kvstore on ``address``: the one the decode worker was told it may fetch from."""
    servicer = FakeKVStore()
    server = grpc.aio.server()
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port(address)
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
