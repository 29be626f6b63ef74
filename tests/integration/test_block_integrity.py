"""A decode worker fed damaged blocks by a fake kvstore (a real gRPC server on 127.0.0.1 that
serves what a prefill engine exported, spoiled on purpose): it recomputes every block whose
bytes, header or length are wrong, its output stays transformers' greedy output, its free
blocks come back, it never caches a refused block, and its Stat counts what it refused."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.kv.blocks import block_checksum
from pdserve.kv.convert import layout_to_proto
from pdserve.local.launcher import free_port
from pdserve.runtime.rpc import aio_channel
from pdserve.testing.cluster import Cluster, decode_idle
from pdserve.testing.reference import hf_greedy_tokens
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 12
PROMPT_LEN = 50  # 3 full blocks of 16 and a tail of 2
TIMEOUT = 60.0


def flipped(block: common_pb2.Block) -> None:
    """Bytes changed in the middle of the block, its checksum left as it was."""
    data = bytearray(block.data)
    half = len(data) // 2
    data[half : half + 256] = bytes(b ^ 0xFF for b in data[half : half + 256])
    block.data = bytes(data)


def wrong_header(block: common_pb2.Block) -> None:
    """The header of another model's blocks."""
    block.layout.model_fingerprint = b"\x00" * 16


def wrong_length(block: common_pb2.Block) -> None:
    """Four bytes short, with the checksum of the short bytes (only the length is wrong)."""
    block.data = block.data[:-4]
    block.checksum = block_checksum(block.key, block.num_tokens, block.data)


def no_checksum(block: common_pb2.Block) -> None:
    block.ClearField("checksum")


SPOIL: dict[str, tuple[Callable[[common_pb2.Block], None], str]] = {
    "flipped": (flipped, "its checksum is"),
    "header": (wrong_header, "its layout header differs (model_fingerprint: ours"),
    "length": (wrong_length, "bytes, a block of this layout has"),
    "checksum": (no_checksum, "it carries no checksum"),
}
# Which of the prompt's 4 blocks (3 full, the tail) are spoiled, and how many of the others
# are imported: only the blocks before the first refused one continue the prompt's prefix.
WHICH = {"second": ([1], 1), "tail": ([3], 3), "all": ([0, 1, 2, 3], 0)}


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


def prompts() -> dict[tuple[str, str], list[int]]:
    """A prompt of its own per case, so that no case finds another's blocks cached."""
    rng = random.Random(14)
    return {
        (spoil, which): [rng.randrange(3, 512) for _ in range(PROMPT_LEN)]
        for spoil in SPOIL
        for which in WHICH
    }


PROMPTS = prompts()


@pytest.fixture(scope="module")
def references(tiny_llama_path) -> dict[tuple[str, str], list[int]]:
    return hf_greedy_tokens(tiny_llama_path, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def prefill(tiny_llama_path) -> LLM:
    return LLM(model=str(tiny_llama_path), dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def decode(tiny_llama_path, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("integrity-logs"))
    try:
        model = ["--model", str(tiny_llama_path), "--dtype", "float32", "--num-kv-blocks", "64"]
        c.kvstore_address = f"127.0.0.1:{free_port()}"
        yield c, c.start("decode", "pdserve.decode", *model, "--kvstore", c.kvstore_address)
    finally:
        c.stop_all()


def exported_blocks(llm: LLM, prompt: list[int], rid: str) -> tuple[int, list[common_pb2.Block]]:
    """The first token and the Block messages a prefill worker would have put."""
    eng = llm.engine
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
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
    async with aio_channel(address) as channel:
        tokens, last = [], None
        async for out in decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=TIMEOUT):
            tokens.extend(out.token_ids)
            last = out
        return tokens, last


@pytest.mark.parametrize("which", list(WHICH))
@pytest.mark.parametrize("spoil", list(SPOIL))
async def test_damaged_blocks_are_recomputed_exactly_and_counted(
    decode, prefill, references, spoil, which
):
    cluster, worker = decode
    prompt, want = PROMPTS[spoil, which], references[spoil, which]
    rid = f"{spoil}-{which}"
    first, blocks = exported_blocks(prefill, prompt, rid)
    assert first == want[0]
    damage, why = SPOIL[spoil]
    spoiled, num_imported = WHICH[which]
    for i in spoiled:
        damage(blocks[i])
    params = common_pb2.SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    before = await decode_idle(worker.address, 10)
    async with fake_kvstore(cluster.kvstore_address) as (kvstore, address):
        kvstore.blocks = {b.key: b for b in blocks}
        request = decode_pb2.DecodeRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            params=params,
            first_token_id=first,
            block_keys=[b.key for b in blocks],
            kvstore_address=address,
            layout=layout_to_proto(prefill.engine.block_layout()),
        )
        tokens, last = await decode_call(worker.address, request)
        assert kvstore.asked == [b.key for b in blocks]
    after = await decode_idle(worker.address, 10)

    assert [first, *tokens] == want
    assert last.finish_reason == "length"
    assert last.num_transferred_tokens == 16 * num_imported
    assert after.kv_blocks_rejected - before.kv_blocks_rejected == len(spoiled)
    assert after.kv_blocks_imported - before.kv_blocks_imported == num_imported
    assert after.num_free_blocks == before.num_free_blocks == after.num_total_blocks
    assert why in worker.log_text()

    # Never cached: the same prompt again, nothing fetched, takes the full blocks from the
    # worker's own prefix cache (now recomputed) and still gives transformers' tokens.
    again = decode_pb2.DecodeRequest()
    again.CopyFrom(request)
    again.request_id = rid + "-again"
    again.ClearField("kvstore_address")
    tokens, last = await decode_call(worker.address, again)
    assert [first, *tokens] == want
    assert last.num_cached_tokens == 48 and last.num_transferred_tokens == 0
    assert (await decode_idle(worker.address, 10)).num_free_blocks == after.num_total_blocks
    assert cluster.unhandled_errors() == []
