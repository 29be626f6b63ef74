"""BlockStore on its own: exact LRU eviction order, byte accounting, counters, layout checks."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.kv.blocks import BlockLayout, LayoutMismatch
from pdserve.kv.convert import layout_from_proto
from pdserve.kvstore.store import BlockStore, StoredBlock

LAYOUT = BlockLayout(
    version=1,
    model_fingerprint=b"\x01\x02",
    dtype="float32",
    block_size=16,
    num_layers=2,
    num_kv_heads=1,
    head_dim=4,
)


def put(store: BlockStore, key: bytes, size: int, num_tokens: int = 16) -> bytes:
    data = key[:1] * size
    store.put(LAYOUT, key, data, num_tokens)
    return data


def get(store: BlockStore, key: bytes) -> StoredBlock | None:
    return store.get(LAYOUT, key)


# -- eviction and capacity ----------------------------------------------------------------


def test_put_evicts_least_recently_used_until_the_block_fits():
    store = BlockStore(100)
    for key in (b"a", b"b", b"c", b"d"):
        put(store, key, 25)
    assert store.bytes_used == 100
    put(store, b"e", 40)  # needs two blocks out: a then b
    assert store.lru_order() == [b"c", b"d", b"e"]
    assert store.bytes_used == 90
    assert store.evictions == 2
    store.check_integrity()


def test_get_makes_a_block_most_recently_used():
    store = BlockStore(75)
    for key in (b"a", b"b", b"c"):
        put(store, key, 25)
    assert get(store, b"a") is not None
    assert store.lru_order() == [b"b", b"c", b"a"]
    put(store, b"d", 25)
    assert store.lru_order() == [b"c", b"a", b"d"]
    assert b"b" not in store
    assert get(store, b"b") is None


def test_block_filling_the_whole_capacity_evicts_everything_else():
    store = BlockStore(100)
    put(store, b"a", 30)
    put(store, b"b", 30)
    put(store, b"c", 100)
    assert store.lru_order() == [b"c"]
    assert (store.bytes_used, store.num_blocks, store.evictions) == (100, 1, 2)


def test_block_larger_than_capacity_is_refused_and_nothing_is_evicted():
    store = BlockStore(100)
    put(store, b"a", 60)
    with pytest.raises(
        ValueError, match="a block of 101 bytes does not fit in the store's capacity of 100 bytes"
    ):
        put(store, b"b", 101)
    assert store.lru_order() == [b"a"]
    assert (store.bytes_used, store.evictions, store.blocks_in) == (60, 0, 1)


def test_replacing_a_key_accounts_only_the_new_size_and_makes_it_most_recent():
    store = BlockStore(100)
    put(store, b"a", 40)
    put(store, b"b", 40)
    put(store, b"a", 10)
    assert store.lru_order() == [b"b", b"a"]
    assert (store.bytes_used, store.num_blocks, store.evictions) == (50, 2, 0)
    assert get(store, b"a") == StoredBlock(b"a" * 10, 16)
    # Growing a block in place evicts others, never itself.
    put(store, b"a", 90)
    assert store.lru_order() == [b"a"]
    assert (store.bytes_used, store.evictions) == (90, 1)
    store.check_integrity()


def test_store_keeps_the_bytes_objects_it_was_given():
    store = BlockStore(100)
    data = put(store, b"a", 10, num_tokens=3)
    block = get(store, b"a")
    assert block.data is data
    assert block.num_tokens == 3


def test_bad_capacity_and_empty_key_are_refused():
    with pytest.raises(ValueError, match="at least 1 byte, got 0"):
        BlockStore(0)
    with pytest.raises(ValueError, match="non-empty key"):
        BlockStore(10).put(LAYOUT, b"", b"x", 1)


# -- counters -----------------------------------------------------------------------------


def test_counters_count_bytes_blocks_hits_misses_and_evictions():
    store = BlockStore(50)
    put(store, b"a", 20)
    put(store, b"b", 20)
    put(store, b"a", 20)  # a replacement is received again
    get(store, b"a")
    get(store, b"a")
    get(store, b"x")
    put(store, b"c", 20)  # evicts b
    get(store, b"b")
    assert {
        "bytes_used": store.bytes_used,
        "num_blocks": store.num_blocks,
        "bytes_in": store.bytes_in,
        "blocks_in": store.blocks_in,
        "bytes_out": store.bytes_out,
        "blocks_out": store.blocks_out,
        "hits": store.hits,
        "misses": store.misses,
        "evictions": store.evictions,
    } == {
        "bytes_used": 40,
        "num_blocks": 2,
        "bytes_in": 80,
        "blocks_in": 4,
        "bytes_out": 40,
        "blocks_out": 2,
        "hits": 2,
        "misses": 2,
        "evictions": 1,
    }


# -- layout ---------------------------------------------------------------------------------


def test_first_put_fixes_the_layout():
    store = BlockStore(100)
    assert store.layout is None
    other = dataclasses.replace(LAYOUT, block_size=32)
    store.check_layout(other)  # nothing fixed yet
    assert store.get(other, b"a") is None  # a get fixes nothing either
    put(store, b"a", 10)
    assert store.layout == LAYOUT
    store.check_layout(LAYOUT)


def test_layout_mismatch_names_each_differing_field_with_both_values():
    store = BlockStore(100)
    put(store, b"a", 10)
    other = dataclasses.replace(LAYOUT, block_size=32, dtype="bfloat16", model_fingerprint=b"\xff")
    with pytest.raises(LayoutMismatch) as info:
        store.put(other, b"b", b"x", 1)
    message = str(info.value)
    assert "model_fingerprint: store 0102, request ff" in message
    assert "dtype: store float32, request bfloat16" in message
    assert "block_size: store 16, request 32" in message
    assert "num_layers" not in message and "head_dim" not in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(LayoutMismatch, match="block_size: store 16, request 32"):
        store.get(other, b"a")
    # A refused request changes nothing.
    assert store.lru_order() == [b"a"]
    assert (store.blocks_in, store.hits, store.misses) == (1, 0, 0)


def test_layout_from_proto_reads_a_block_layout_message():
    from pdserve.v1 import common_pb2

    message = common_pb2.BlockLayout(
        version=1,
        model_fingerprint=b"\x01\x02",
        dtype="float32",
        block_size=16,
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
    )
    assert layout_from_proto(message) == LAYOUT
    assert [f.name for f in dataclasses.fields(BlockLayout)] == [
        f.name for f in common_pb2.BlockLayout.DESCRIPTOR.fields
    ]


# -- batching for the wire ------------------------------------------------------------------


def test_batches_hold_at_most_max_bytes_and_a_larger_item_goes_alone():
    from pdserve.kv.client import batched_by_bytes

    sizes = [3, 3, 2, 5, 1, 4, 4]
    assert list(batched_by_bytes(sizes, lambda n: n, 4)) == [[3], [3], [2], [5], [1], [4], [4]]
    assert list(batched_by_bytes(sizes, lambda n: n, 8)) == [[3, 3, 2], [5, 1], [4, 4]]
    assert list(batched_by_bytes([], lambda n: n, 8)) == []


# -- leases and single-use blocks ---------------------------------------------------------


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def leased_store(capacity: int = 100, lease_s: float = 10.0) -> tuple[BlockStore, Clock]:
    clock = Clock()
    return BlockStore(capacity, lease_s=lease_s, clock=clock), clock


def test_a_block_nobody_fetches_expires_at_the_end_of_its_lease():
    store, clock = leased_store()
    put(store, b"a", 10)
    clock.now += 5
    put(store, b"b", 10)
    assert store.num_leased == 2
    clock.now += 4.9
    assert store.expire() == 0
    clock.now += 0.1  # a's lease (10 s) is over, b's has 5 s left
    assert store.expire() == 1
    assert store.lru_order() == [b"b"]
    assert (store.expired, store.num_leased, store.bytes_used) == (1, 1, 10)
    clock.now += 5
    assert get(store, b"b") is None  # a get expires first: b's lease ended just now
    assert (store.expired, store.num_blocks, store.bytes_used, store.misses) == (2, 0, 0, 1)
    store.check_integrity()


def test_a_fetched_block_is_a_shared_prefix_kept_under_lru_only():
    store, clock = leased_store()
    put(store, b"a", 10)
    assert get(store, b"a") is not None
    assert store.num_leased == 0
    put(store, b"a", 10)  # another request pushes the same prefix: still no lease
    clock.now += 1000
    assert store.expire() == 0
    assert store.lru_order() == [b"a"] and store.expired == 0
    store.check_integrity()


def test_a_put_again_before_any_get_renews_the_lease():
    store, clock = leased_store()
    put(store, b"a", 10)
    put(store, b"b", 10)
    clock.now += 8
    put(store, b"a", 10)  # a's lease now ends at +18, after b's
    clock.now += 2
    assert store.expire() == 1
    assert store.lru_order() == [b"a"]
    clock.now += 8
    assert store.expire() == 1 and store.num_blocks == 0
    store.check_integrity()


def test_an_evicted_block_loses_its_lease_and_is_not_counted_expired():
    store, clock = leased_store(capacity=20)
    put(store, b"a", 10)
    put(store, b"b", 10)
    put(store, b"c", 10)  # evicts a
    assert (store.evictions, store.num_leased) == (1, 2)
    clock.now += 10
    assert store.expire() == 2
    assert (store.expired, store.num_blocks, store.bytes_used) == (2, 0, 0)
    store.check_integrity()


def test_a_single_use_get_drops_the_block_once_read():
    store, _ = leased_store()
    data = put(store, b"tail/r1", 10, num_tokens=3)
    put(store, b"h", 10)
    block = store.get(LAYOUT, b"tail/r1", single_use=True)
    assert block == StoredBlock(data, 3)
    assert store.lru_order() == [b"h"]
    assert (store.dropped, store.hits, store.blocks_out, store.bytes_out) == (1, 1, 1, 10)
    assert store.get(LAYOUT, b"tail/r1", single_use=True) is None  # a miss, not a drop
    assert (store.dropped, store.misses, store.bytes_used, store.num_leased) == (1, 1, 10, 1)
    store.check_integrity()


def test_without_a_lease_nothing_expires():
    store = BlockStore(100)
    put(store, b"a", 10)
    assert (store.num_leased, store.expire()) == (0, 0)
    with pytest.raises(ValueError, match="positive seconds or None, got 0"):
        BlockStore(100, lease_s=0)


# -- evictions to a slower tier -----------------------------------------------------------


def test_only_lru_evictions_go_to_on_evict():
    evicted = []
    clock = Clock()
    store = BlockStore(
        30,
        lease_s=10.0,
        clock=clock,
        on_evict=lambda layout, key, block: evicted.append((layout, key, block.data)),
    )
    put(store, b"expires", 10)
    put(store, b"dropped", 10)
    store.get(LAYOUT, b"dropped", single_use=True)
    clock.now += 10
    assert store.expire() == 1 and evicted == []  # expired and dropped blocks are dead
    for key in (b"a", b"b", b"c", b"d"):
        put(store, key, 10)
    assert evicted == [(LAYOUT, b"a", b"a" * 10)]
    put(store, b"d", 10)  # replacing a block evicts nothing
    assert [key for _, key, _ in evicted] == [b"a"]


def test_promote_counts_a_block_served_and_holds_it_most_recent_without_a_lease():
    evicted = []
    store = BlockStore(20, lease_s=10.0, on_evict=lambda layout, key, b: evicted.append(key))
    put(store, b"a", 10)
    put(store, b"b", 10)
    store.promote(LAYOUT, b"c", StoredBlock(b"c" * 10, 16, 7))
    assert store.lru_order() == [b"b", b"c"] and evicted == [b"a"]
    assert (store.blocks_out, store.bytes_out, store.hits, store.num_leased) == (1, 10, 0, 1)
    assert store.get(LAYOUT, b"c") == StoredBlock(b"c" * 10, 16, 7)

    store.promote(LAYOUT, b"tail", StoredBlock(b"t" * 5, 3), single_use=True)
    assert b"tail" not in store and store.dropped == 1
    store.promote(LAYOUT, b"huge", StoredBlock(b"h" * 21, 16))  # served, not held
    assert b"huge" not in store and store.blocks_out == 4
    store.check_integrity()
