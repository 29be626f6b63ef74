"""A decode worker fed damaged blocks by a fake kvstore (a real gRPC server on 127.0.0.1 that
serves what a prefill engine exported, spoiled on purpose): it recomputes every block whose
bytes, header or length are wrong, its output stays transformers' greedy output, its free
blocks come back, it never caches a refused block, and its Stat counts what it refused."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from pdserve.kv.blocks import block_checksum
from pdserve.kv.convert import layout_to_proto
from pdserve.local.launcher import free_port
from pdserve.testing.cluster import decode_idle
from pdserve.testing.reference import hf_greedy_tokens
from pdserve.v1 import common_pb2, decode_pb2
from tests.helpers.clusters import running
from tests.helpers.flags import engine_flags
from tests.helpers.kv_blocks import decode_call, exported_blocks, fake_kvstore

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 12
PROMPT_LEN = 50  # 3 full blocks of 16 and a tail of 2


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
def decode(tiny_llama_path, tmp_path_factory):
    model = ["--model", str(tiny_llama_path), *engine_flags(num_kv_blocks=64)]
    with running(tmp_path_factory.mktemp("integrity-logs")) as c:
        c.kvstore_address = f"127.0.0.1:{free_port()}"
        yield c, c.start("decode", "pdserve.decode", *model, "--kvstore", c.kvstore_address)


@pytest.mark.parametrize("which", list(WHICH))
@pytest.mark.parametrize("spoil", list(SPOIL))
async def test_damaged_blocks_are_recomputed_exactly_and_counted(
    decode, prefill_engine, references, spoil, which
):
    cluster, worker = decode
    prompt, want = PROMPTS[spoil, which], references[spoil, which]
    rid = f"{spoil}-{which}"
    first, blocks = exported_blocks(prefill_engine, prompt, rid, MAX_NEW)
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
            layout=layout_to_proto(prefill_engine.engine.block_layout()),
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
