"""Two NIXL endpoints in one process (UCX on loopback): a prefill endpoint stages blocks,
a decode endpoint reads them, checks each checksum, and its notification frees the
prefill's slots. Skipped where NIXL is not installed (`pdserve[nixl]`).

Each scenario runs in a process of its own: NIXL's libraries, once loaded, make a later
load of grpc_tools' protoc (test_protos) crash the process (a segfault: their bundled
libraries clash), and a crashed pytest-xdist worker can stall the whole run. Workers never
load protoc."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from pdserve.kv.blocks import ExportedBlock
from pdserve.worker.nixl import NixlEndpoint, NixlReadError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None, reason="NIXL is not installed (pdserve[nixl])"
)

BLOCK = 64 * 1024


def _blocks(n: int) -> list[ExportedBlock]:
    return [ExportedBlock(f"key-{i}".encode(), memoryview(os.urandom(BLOCK)), 16) for i in range(n)]


async def _polling(endpoint: NixlEndpoint) -> None:
    """What a prefill worker does all along: read notifications (which also progresses its
    agent: a connection's wire-up needs both sides to)."""
    while True:
        await endpoint.poll()
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def _endpoints():
    made = [NixlEndpoint(f"p-{os.getpid()}", 8 * BLOCK, BLOCK)]
    made.append(NixlEndpoint(f"d-{os.getpid()}", 8 * BLOCK, BLOCK))
    try:
        yield made
    finally:
        for e in made:
            e.close()


def _apart(scenario) -> None:
    """Run ``scenario`` in a fresh process; its assertion errors are raised here."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(scenario).result(timeout=120)


def test_blocks_read_exactly_and_slots_freed() -> None:
    _apart(_read_exactly)


def test_a_full_buffer_and_a_wrong_peer() -> None:
    _apart(_full_buffer_and_wrong_peer)


def _read_exactly() -> None:
    with _endpoints() as (prefill, decode):
        _read_exactly_on(prefill, decode)


def _full_buffer_and_wrong_peer() -> None:
    with _endpoints() as (prefill, decode):
        _full_buffer_and_wrong_peer_on(prefill, decode)


def _read_exactly_on(prefill: NixlEndpoint, decode: NixlEndpoint) -> None:

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


def _full_buffer_and_wrong_peer_on(prefill: NixlEndpoint, decode: NixlEndpoint) -> None:

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
