"""The kvstore's disk tier as a real process over 127.0.0.1: blocks evicted from memory
come back exactly from disk, a damaged file is never served, and a kvstore started again
on the same --disk-path serves its blocks (one of another layout refuses to start)."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import time

import pytest

from pdserve.kv.blocks import block_checksum
from pdserve.kv.client import KVStoreClient
from pdserve.kv.convert import layout_from_proto
from pdserve.kvstore.blockfile import block_path
from pdserve.kvstore.store import layout_to_text
from pdserve.local.launcher import Child, Launcher
from pdserve.runtime.rpc import aio_channel
from pdserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc

pytestmark = pytest.mark.timeout(90)

MiB = 2**20
TIMEOUT = 10.0
# float32 blocks of 32 layers x 2 (K, V) x 4 KV heads x 16 tokens x 64 dims: 1 MiB each.
LAYOUT = common_pb2.BlockLayout(
    version=2,
    model_fingerprint=b"\xcd" * 16,
    dtype="float32",
    block_size=16,
    num_layers=32,
    num_kv_heads=4,
    head_dim=64,
)
MEMORY_BLOCKS = 4


def blocks(prefix: str, n: int) -> list[tuple[bytes, bytes, int]]:
    """``n`` 1 MiB blocks of distinct contents, keyed ``<prefix>/<i>``."""
    return [(f"{prefix}/{i}".encode(), bytes([i % 256, 7]) * (MiB // 2), 16) for i in range(n)]


def start_kvstore(launcher: Launcher, name: str, disk_path, *flags: str) -> Child:
    argv = [
        *(sys.executable, "-m", "pdserve.kvstore", "--port", "0"),
        *("--capacity-bytes", str(MEMORY_BLOCKS * MiB)),
        *("--disk-path", str(disk_path), "--disk-capacity-bytes", "64MiB"),
        *flags,
    ]
    return launcher.start_ready(name, argv, ["kvstore"], timeout=30)


async def stat_until(client: KVStoreClient, done, within_s: float = 10.0):
    """The store's Stat once ``done(stat)`` holds (the disk writer has caught up)."""
    deadline = time.monotonic() + within_s
    while not done(stat := await client.stat(timeout=TIMEOUT)):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s} s: {stat}")
        await asyncio.sleep(0.05)
    return stat


async def test_evicted_blocks_come_back_from_disk_exactly_and_a_damaged_one_never(
    launcher, tmp_path
):
    kvstore = start_kvstore(launcher, "kvstore-disk", tmp_path / "tier")
    sent = blocks("ev", 10)
    async with KVStoreClient(kvstore.address) as client:
        await client.put_blocks(LAYOUT, sent, timeout=TIMEOUT)
        stat = await stat_until(client, lambda s: s.disk_writes == 6)
        assert (stat.num_blocks, stat.evictions) == (MEMORY_BLOCKS, 6)
        assert (stat.disk_blocks, stat.disk_capacity_bytes) == (6, 64 * MiB)
        assert 6 * MiB < stat.disk_bytes_used < 6 * MiB + 6 * 4096

        # The oldest six are on disk only: served with their bytes and the sender's
        # checksum (the client checks it), and promoted back into memory.
        keys = [key for key, _, _ in sent]
        fetched = await client.get_blocks(LAYOUT, [*keys[:6], b"ev/none"], timeout=TIMEOUT)
        assert fetched.found == {key: data for key, data, _ in sent[:6]}
        assert (fetched.missing, fetched.rejected) == ([b"ev/none"], {})
        stat = await client.stat(timeout=TIMEOUT)
        assert (stat.disk_hits, stat.misses - stat.disk_hits) == (6, 1)
        async with aio_channel(kvstore.address) as channel:
            call = kvstore_pb2_grpc.KVStoreStub(channel).GetBlocks(
                kvstore_pb2.GetBlocksRequest(layout=LAYOUT, keys=keys), timeout=TIMEOUT
            )
            served = {b.key: b async for r in call for b in r.blocks}
        assert {k: (b.data, b.checksum, b.num_tokens) for k, b in served.items()} == {
            k: (d, block_checksum(k, n, d), n) for k, d, n in sent
        }

        # Damage one file on disk (a block in memory no more): it is deleted, not served.
        await client.put_blocks(LAYOUT, blocks("push", MEMORY_BLOCKS), timeout=TIMEOUT)
        await stat_until(client, lambda s: s.disk_writes == 10)  # each block written once
        path = block_path(tmp_path / "tier", b"ev/9")
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(raw)
        fetched = await client.get_blocks(LAYOUT, [b"ev/9", b"ev/8"], timeout=TIMEOUT)
        assert (list(fetched.found), fetched.missing) == ([b"ev/8"], [b"ev/9"])
        assert (await client.stat(timeout=TIMEOUT)).disk_damaged == 1
        assert not path.exists()
        fetched = await client.get_blocks(LAYOUT, [b"ev/9"], timeout=TIMEOUT)
        assert fetched.missing == [b"ev/9"]  # forgotten: not read again
        assert (await client.stat(timeout=TIMEOUT)).disk_damaged == 1
    assert "fails its check (CRC-32" in kvstore.log_text()


async def test_a_kvstore_started_again_on_its_disk_path_serves_its_blocks(launcher, tmp_path):
    tier = tmp_path / "tier"
    first = start_kvstore(launcher, "kvstore-first", tier)
    sent = blocks("kept", 6)
    async with KVStoreClient(first.address) as client:
        await client.put_blocks(LAYOUT, sent, timeout=TIMEOUT)
        await stat_until(client, lambda s: s.disk_writes == 2)
    launcher.stop([first], 10)  # SIGTERM: the 4 blocks memory holds are written too
    assert first.proc.returncode == 0

    again = start_kvstore(launcher, "kvstore-again", tier)  # its layout from layout.txt
    async with KVStoreClient(again.address) as client:
        stat = await client.stat(timeout=TIMEOUT)
        assert (stat.num_blocks, stat.disk_blocks) == (0, 6)
        fetched = await client.get_blocks(
            LAYOUT, [b"kept/0", b"kept/1", b"kept/5", b"kept/9"], timeout=TIMEOUT
        )
        assert fetched.found == {key: data for key, data, _ in sent[:2] + sent[5:]}
        assert (fetched.missing, fetched.rejected) == ([b"kept/9"], {})
    assert "holding 6 blocks" in again.log_text()
    launcher.stop([again], 10)

    other = dataclasses.replace(layout_from_proto(LAYOUT), block_size=32)
    refused = subprocess.run(
        [
            *(sys.executable, "-m", "pdserve.kvstore", "--port", "0"),
            *("--disk-path", str(tier), "--block-layout", layout_to_text(other)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2, refused.stderr
    assert f"--disk-path {tier} holds blocks of another layout" in refused.stderr
    assert "block_size: --disk-path 16, --block-layout 32" in refused.stderr
