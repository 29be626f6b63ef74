"""The kvstore as a real process over 127.0.0.1: streamed put/get, LRU, leases, single-use
blocks, layout checks, health."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.kv.blocks import block_checksum
from pdserve.kv.client import KVStoreClient, put_requests
from pdserve.local.launcher import Child, Launcher
from pdserve.runtime.rpc import STREAM_CHUNK_BYTES, aio_channel
from pdserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc

pytestmark = pytest.mark.timeout(60)

MiB = 2**20
CAPACITY = 16 * MiB
TIMEOUT = 10.0
# float32 blocks of 32 layers x 2 (K, V) x 4 KV heads x 16 tokens x 64 dims: 1 MiB each.
LAYOUT = common_pb2.BlockLayout(
    version=1,
    model_fingerprint=b"\xab" * 16,
    dtype="float32",
    block_size=16,
    num_layers=32,
    num_kv_heads=4,
    head_dim=64,
)


def other_layout(**changes) -> common_pb2.BlockLayout:
    layout = common_pb2.BlockLayout()
    layout.CopyFrom(LAYOUT)
    for name, value in changes.items():
        setattr(layout, name, value)
    return layout


def blocks(prefix: str, n: int, size: int = MiB) -> list[tuple[bytes, bytes, int]]:
    """``n`` blocks of distinct contents, keyed ``<prefix>/<i>``."""
    return [(f"{prefix}/{i}".encode(), bytes([i % 256]) * size, 16) for i in range(n)]


KVSTORE = [sys.executable, "-m", "pdserve.kvstore", "--port", "0"]


@pytest.fixture(scope="module")
def launcher(tmp_path_factory) -> Launcher:
    launcher = Launcher(tmp_path_factory.mktemp("kvstore"))
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def kvstore(launcher) -> Child:
    argv = [*KVSTORE, "--capacity-bytes", str(CAPACITY)]
    return launcher.start_ready("kvstore", argv, ["kvstore"], timeout=30)


@pytest.fixture
async def client(kvstore):
    async with KVStoreClient(kvstore.address) as c:
        yield c


@pytest.fixture
async def stub(kvstore):
    async with aio_channel(kvstore.address) as channel:
        yield kvstore_pb2_grpc.KVStoreStub(channel)


# -- transfer -----------------------------------------------------------------------------


def test_put_is_streamed_in_messages_of_at_most_the_chunk_size():
    requests = list(put_requests(LAYOUT, blocks("split", 12)))
    assert [len(r.blocks) for r in requests] == [4, 4, 4]
    assert [r.HasField("layout") for r in requests] == [True, False, False]
    assert all(sum(len(b.data) for b in r.blocks) <= STREAM_CHUNK_BYTES for r in requests)
    (empty,) = put_requests(LAYOUT, [])
    assert empty.layout == LAYOUT and not empty.blocks
    (viewed,) = put_requests(LAYOUT, [(b"v", memoryview(bytearray(b"\x01\x02")), 1)])
    assert viewed.blocks[0].data == b"\x01\x02"


async def test_round_trip_of_12_MiB_in_several_messages(client, stub):
    sent = blocks("trip", 12)
    response = await client.put_blocks(LAYOUT, sent, timeout=TIMEOUT)
    assert (response.num_stored, response.bytes_stored) == (12, 12 * MiB)

    keys = [key for key, _, _ in sent]
    fetched = await client.get_blocks(LAYOUT, [*keys, b"trip/none"], timeout=TIMEOUT)
    assert fetched.found == {key: data for key, data, _ in sent}
    assert fetched.missing == [b"trip/none"] and fetched.rejected == {}

    # On the wire: three messages of 4 MiB of data; `missing` only in the last.
    call = stub.GetBlocks(
        kvstore_pb2.GetBlocksRequest(layout=LAYOUT, keys=[*keys, b"trip/none"]), timeout=TIMEOUT
    )
    responses = [r async for r in call]
    assert [len(r.blocks) for r in responses] == [4, 4, 4]
    assert [list(r.missing) for r in responses] == [[], [], [b"trip/none"]]
    assert [b.num_tokens for r in responses for b in r.blocks] == [16] * 12
    # Each block carries its header and its checksum back.
    assert all(b.layout == LAYOUT for r in responses for b in r.blocks)
    assert [b.checksum for r in responses for b in r.blocks] == [
        block_checksum(k, n, d) for k, d, n in sent
    ]


async def test_get_of_only_missing_keys_still_answers_one_message(client, stub):
    fetched = await client.get_blocks(LAYOUT, [b"gone/1", b"gone/2"], timeout=TIMEOUT)
    assert (fetched.found, fetched.missing) == ({}, [b"gone/1", b"gone/2"])
    call = stub.GetBlocks(kvstore_pb2.GetBlocksRequest(layout=LAYOUT), timeout=TIMEOUT)
    assert [(list(r.blocks), list(r.missing)) async for r in call] == [([], [])]


async def test_lru_eviction_under_capacity_seen_through_stat_and_get(client):
    n = CAPACITY // MiB
    await client.put_blocks(LAYOUT, blocks("lru", n), timeout=TIMEOUT)  # fills the store
    before = await client.stat(timeout=TIMEOUT)
    assert (before.num_blocks, before.bytes_used, before.capacity_bytes) == (n, CAPACITY, CAPACITY)

    fetched = await client.get_blocks(LAYOUT, [b"lru/0"], timeout=TIMEOUT)  # now most recent
    assert list(fetched.found) == [b"lru/0"]
    await client.put_blocks(LAYOUT, blocks("lru-new", 1), timeout=TIMEOUT)  # evicts lru/1

    after = await client.stat(timeout=TIMEOUT)
    assert after.evictions - before.evictions == 1
    assert (after.num_blocks, after.bytes_used) == (n, CAPACITY)
    assert after.bytes_in - before.bytes_in == MiB
    assert (after.hits - before.hits, after.bytes_out - before.bytes_out) == (1, MiB)
    fetched = await client.get_blocks(
        LAYOUT, [b"lru/0", b"lru/1", b"lru/2", b"lru-new/0"], timeout=TIMEOUT
    )
    assert sorted(fetched.found) == [b"lru-new/0", b"lru/0", b"lru/2"]
    assert fetched.missing == [b"lru/1"]


# -- leases and single-use blocks ----------------------------------------------------------

LEASE_S = 1.0


@pytest.fixture(scope="module")
def leased_kvstore(launcher) -> Child:
    argv = [*KVSTORE, "--capacity-bytes", str(CAPACITY), "--block-lease", str(LEASE_S)]
    return launcher.start_ready("kvstore-leased", argv, ["kvstore"], timeout=30)


async def stat_until(client: KVStoreClient, done, within_s: float) -> kvstore_pb2.StatResponse:
    """The store's Stat once ``done(stat)`` holds; fails after ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        stat = await client.stat(timeout=TIMEOUT)
        if done(stat):
            return stat
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s} s: {stat}")
        await asyncio.sleep(0.05)


async def test_blocks_nobody_fetched_expire_and_fetched_ones_stay(leased_kvstore):
    async with KVStoreClient(leased_kvstore.address) as client:
        before = await client.stat(timeout=TIMEOUT)
        shared, abandoned = blocks("shared", 2), blocks("abandoned", 3)
        await client.put_blocks(LAYOUT, [*shared, *abandoned], timeout=TIMEOUT)
        fetched = await client.get_blocks(LAYOUT, [k for k, _, _ in shared], timeout=TIMEOUT)
        assert len(fetched.found) == 2
        assert (await client.stat(timeout=TIMEOUT)).num_leased == before.num_leased + 3

        # The timer looks every quarter lease: gone within 1.25 leases (the bound checked
        # here leaves room for a loaded machine).
        after = await stat_until(
            client, lambda s: s.expired == before.expired + 3, within_s=LEASE_S * 10
        )
        assert (after.num_blocks, after.num_leased) == (before.num_blocks + 2, before.num_leased)
        assert after.bytes_used == before.bytes_used + 2 * MiB
        assert after.evictions == before.evictions
        keys = [k for k, _, _ in [*shared, *abandoned]]
        fetched = await client.get_blocks(LAYOUT, keys, timeout=TIMEOUT)
        assert sorted(fetched.found) == [b"shared/0", b"shared/1"]
        assert fetched.missing == [b"abandoned/0", b"abandoned/1", b"abandoned/2"]


async def test_a_single_use_block_is_dropped_once_fetched(leased_kvstore):
    async with KVStoreClient(leased_kvstore.address) as client:
        before = await client.stat(timeout=TIMEOUT)
        sent = blocks("req", 2)
        tail = (b"tail/req", bytes([9]) * MiB, 5)
        await client.put_blocks(LAYOUT, [*sent, tail], timeout=TIMEOUT)
        keys = [b"req/0", b"req/1", b"tail/req"]
        fetched = await client.get_blocks(LAYOUT, keys, timeout=TIMEOUT, single_use=[b"tail/req"])
        assert fetched.found == {k: d for k, d, _ in [*sent, tail]}
        after = await client.stat(timeout=TIMEOUT)
        assert after.dropped - before.dropped == 1
        assert (after.num_blocks, after.num_leased) == (before.num_blocks + 2, before.num_leased)
        assert after.bytes_used == before.bytes_used + 2 * MiB
        again = await client.get_blocks(LAYOUT, keys, timeout=TIMEOUT, single_use=[b"tail/req"])
        assert (sorted(again.found), again.missing) == ([b"req/0", b"req/1"], [b"tail/req"])


async def test_block_lease_zero_turns_leases_off(launcher):
    argv = [*KVSTORE, "--capacity-bytes", "4MiB", "--block-lease", "0"]
    child = launcher.start_ready("kvstore-no-lease", argv, ["kvstore"], timeout=30)
    try:
        async with KVStoreClient(child.address) as client:
            await client.put_blocks(LAYOUT, blocks("kept", 1), timeout=TIMEOUT)
            stat = await client.stat(timeout=TIMEOUT)
            assert (stat.num_blocks, stat.num_leased, stat.expired) == (1, 0, 0)
        assert "block lease off" in child.log_text()
    finally:
        launcher.stop([child], 10)


# -- refusals -----------------------------------------------------------------------------


async def test_layout_mismatch_fails_put_and_get_with_the_differing_fields(client):
    await client.put_blocks(LAYOUT, blocks("fixed", 1), timeout=TIMEOUT)
    wrong = other_layout(block_size=32, dtype="bfloat16")

    with pytest.raises(grpc.aio.AioRpcError) as put_error:
        await client.put_blocks(wrong, blocks("wrong", 2), timeout=TIMEOUT)
    with pytest.raises(grpc.aio.AioRpcError) as get_error:
        await client.get_blocks(wrong, [b"fixed/0"], timeout=TIMEOUT)
    for error in (put_error.value, get_error.value):
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "dtype: store float32, request bfloat16" in error.details()
        assert "block_size: store 16, request 32" in error.details()
    fetched = await client.get_blocks(LAYOUT, [b"wrong/0"], timeout=TIMEOUT)
    assert fetched.missing == [b"wrong/0"]


async def test_first_put_message_without_layout_is_invalid(stub):
    request = kvstore_pb2.PutBlocksRequest(blocks=[common_pb2.Block(key=b"k", data=b"x")])
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.PutBlocks(iter([request]), timeout=TIMEOUT)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "the first PutBlocks message must carry the block layout"


async def test_layout_changing_within_one_put_stream_is_invalid(stub):
    requests = [
        kvstore_pb2.PutBlocksRequest(layout=LAYOUT),
        kvstore_pb2.PutBlocksRequest(layout=other_layout(head_dim=128)),
    ]
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.PutBlocks(iter(requests), timeout=TIMEOUT)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "head_dim: first message 64, this message 128" in error.value.details()


async def test_a_block_without_its_header_or_checksum_or_of_another_layout_is_invalid(stub):
    data = bytes(MiB)
    sound = common_pb2.Block(
        key=b"h/0",
        data=data,
        num_tokens=16,
        layout=LAYOUT,
        checksum=block_checksum(b"h/0", 16, data),
    )
    bare = common_pb2.Block(key=b"h/1", data=data, num_tokens=16)
    no_checksum = common_pb2.Block(key=b"h/2", data=data, num_tokens=16, layout=LAYOUT)
    other = common_pb2.Block()
    other.CopyFrom(sound)
    other.layout.CopyFrom(other_layout(num_layers=16))
    for block, message in [
        (bare, "carries no layout header or no checksum"),
        (no_checksum, "carries no layout header or no checksum"),
        (other, "has another layout than its stream: num_layers: stream 32, block 16"),
    ]:
        request = kvstore_pb2.PutBlocksRequest(layout=LAYOUT, blocks=[sound, block])
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.PutBlocks(iter([request]), timeout=TIMEOUT)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.value.details()


async def test_a_damaged_block_comes_back_rejected_with_why(client, stub):
    """The kvstore keeps a block's checksum as it came; the client checks it on the way out."""
    data = bytes([7]) * MiB
    good = block_checksum(b"dmg/0", 16, data)
    damaged = [
        common_pb2.Block(key=b"dmg/0", data=data, num_tokens=16, layout=LAYOUT, checksum=good),
        common_pb2.Block(key=b"dmg/1", data=data, num_tokens=16, layout=LAYOUT, checksum=good),
        common_pb2.Block(key=b"dmg/2", data=data[:-1], num_tokens=16, layout=LAYOUT, checksum=good),
    ]
    await stub.PutBlocks(
        iter([kvstore_pb2.PutBlocksRequest(layout=LAYOUT, blocks=damaged)]), timeout=TIMEOUT
    )
    fetched = await client.get_blocks(LAYOUT, [b"dmg/0", b"dmg/1", b"dmg/2"], timeout=TIMEOUT)
    assert list(fetched.found) == [b"dmg/0"]
    assert "checksum" in fetched.rejected[b"dmg/1"]  # another key: another checksum
    assert "has 1048575 bytes" in fetched.rejected[b"dmg/2"]


async def test_block_larger_than_the_capacity_is_invalid(client):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.put_blocks(LAYOUT, blocks("huge", 1, CAPACITY + 1), timeout=TIMEOUT)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not fit in the store's capacity" in error.value.details()


async def test_client_refuses_a_call_without_a_positive_timeout(client):
    with pytest.raises(ValueError, match="positive timeout"):
        await client.stat(timeout=0)


# -- service plumbing -----------------------------------------------------------------------


async def test_health_reports_serving_and_reflection_lists_the_service(kvstore):
    async with aio_channel(kvstore.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        response = await health.Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.KVStore"), timeout=TIMEOUT
        )
        assert response.status == health_pb2.HealthCheckResponse.SERVING

        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT
        )
        names = [s.name async for r in call for s in r.list_services_response.service]
        assert "pdserve.v1.KVStore" in names


async def test_pdserve_kvstore_reads_env_and_stops_cleanly_on_sigterm(launcher):
    argv = [sys.executable, "-m", "pdserve.cli", "kvstore", "--port", "0"]
    env = {"PDSERVE_CAPACITY_BYTES": "3MiB"}
    child = launcher.start_ready("kvstore-env", argv, ["kvstore"], timeout=30, env=env)
    assert child.address.startswith("127.0.0.1:") and not child.address.endswith(":0")
    async with KVStoreClient(child.address) as c:
        assert (await c.stat(timeout=TIMEOUT)).capacity_bytes == 3 * MiB
    child.signal(signal.SIGTERM)
    assert child.proc.wait(timeout=10) == 0
