"""Two NIXL endpoints in one process (UCX on loopback): a prefill endpoint stages blocks,
a decode endpoint reads them, checks each checksum, and its notification frees the
prefill's slots. Skipped where NIXL is not installed (`pdserve[nixl]`)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

from pdserve.kv.blocks import ExportedBlock  # noqa: E402
from pdserve.worker.nixl import NixlEndpoint, NixlReadError  # noqa: E402

BLOCK = 64 * 1024


def _blocks(n: int) -> list[ExportedBlock]:
    return [ExportedBlock(f"key-{i}".encode(), memoryview(os.urandom(BLOCK)), 16) for i in range(n)]


async def _polling(endpoint: NixlEndpoint) -> None:
    """What a prefill worker does all along: read notifications (which also progresses its
    agent: a connection's wire-up needs both sides to)."""
    while True:
        await endpoint.poll()
        await asyncio.sleep(0.005)


@pytest.fixture
def endpoints():
    made = [NixlEndpoint(f"p-{os.getpid()}", 8 * BLOCK, BLOCK)]
    made.append(NixlEndpoint(f"d-{os.getpid()}", 8 * BLOCK, BLOCK))
    yield made
    for e in made:
        e.close()


def test_blocks_read_exactly_and_slots_freed(endpoints) -> None:
    prefill, decode = endpoints

    async def run() -> None:
        poller = asyncio.create_task(_polling(prefill))
        blocks = _blocks(5)
        staged = await prefill.stage("req-1/x", blocks)
        assert staged is not None and prefill.slots.num_free == 3
        wanted = [
            (b.key, addr, crc, b.num_tokens)
            for b, addr, crc in zip(blocks, staged.addresses, staged.checksums, strict=True)
        ]
        # A wrong checksum is refused, never served.
        wanted[2] = (wanted[2][0], wanted[2][1], wanted[2][2] ^ 1, 16)
        fetched = await decode.read(
            prefill.name, prefill.name, prefill.metadata(), "req-1/x", wanted[1:], 10.0
        )
        assert set(fetched.found) == {b.key for b in blocks[1:]} - {blocks[2].key}
        assert list(fetched.rejected) == [blocks[2].key]
        for b in blocks[1:]:
            if b.key in fetched.found:
                assert bytes(fetched.found[b.key]) == bytes(b.data)
        assert decode.slots.num_free == 4
        fetched.done()
        assert decode.slots.num_free == 8
        # The reader's notification ends the lease on the prefill side.
        deadline = time.monotonic() + 10
        while prefill.slots.num_free < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        poller.cancel()
        assert prefill.slots.num_free == 8
        assert prefill.counters.released == 1

    asyncio.run(run())


def test_a_full_buffer_and_a_wrong_peer(endpoints) -> None:
    prefill, decode = endpoints

    async def run() -> None:
        assert await prefill.stage("big", _blocks(9)) is None  # 8 slots
        assert prefill.slots.num_free == 8
        staged = await prefill.stage("r", _blocks(1))
        with pytest.raises(NixlReadError, match="names agent"):
            await decode.read(
                "w",
                "someone-else",
                prefill.metadata(),
                "r",
                [(b"k", staged.addresses[0], 0, 16)],
                5,
            )
        assert decode.slots.num_free == 8  # a failed read gives its slots back

    asyncio.run(run())
