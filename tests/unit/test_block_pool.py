"""BlockPool and hash_block on the CPU: exact block ids, LRU order, ref counts, cache index."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.block_pool import BlockPool
from pdserve.kv.hashing import BlockHash, hash_block

FP = b"fingerprint"


def h(i: int) -> BlockHash:
    """A distinct block hash per ``i``."""
    return hash_block(None, [i], FP)


# -- allocation order ---------------------------------------------------------------------


def test_fresh_pool_allocates_ids_in_order_until_empty():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) == [2, 3]
    assert pool.ref_counts == [1, 1, 1, 1]
    assert pool.num_free_blocks == 0
    assert pool.usage() == 1.0
    assert not pool.can_allocate(1)
    assert pool.can_allocate(0)
    with pytest.raises(RuntimeError, match=r"bug: allocate\(1\) with 0 free blocks"):
        pool.allocate(1)
    pool.check_integrity()


def test_allocate_reuses_least_recently_freed_first():
    pool = BlockPool(4)
    pool.allocate(4)
    pool.free([2])
    pool.free([0])
    pool.free([3])
    assert pool.usage() == 0.25
    assert pool.allocate(2) == [2, 0]
    pool.free([1])
    assert pool.allocate(2) == [3, 1]
    pool.check_integrity()


def test_free_of_several_blocks_queues_them_in_the_given_order():
    pool = BlockPool(5)
    pool.allocate(5)
    pool.free([4, 1, 3])
    assert pool.allocate(3) == [4, 1, 3]


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="at least one block, got 0"):
        BlockPool(0)


# -- free keeps the hash; a lookup revives the block ---------------------------------------


def test_freed_block_keeps_its_hash_and_a_touch_revives_it():
    pool = BlockPool(3)
    assert pool.allocate(1) == [0]
    pool.cache(0, h(0))
    pool.free([0])
    assert pool.num_free_blocks == 3
    assert pool.lookup(h(0)) == 0
    assert pool.num_cached_blocks == 1
    assert pool.block_hashes[0] == h(0)

    pool.touch([0])  # a prefix-cache hit takes it off the free list
    assert pool.ref_counts[0] == 1
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [1, 2]
    assert pool.lookup(h(0)) == 0
    assert pool.num_evictions == 0
    pool.check_integrity()


def test_touch_moves_a_free_block_to_the_tail_when_freed_again():
    pool = BlockPool(3)
    pool.allocate(3)
    pool.cache(0, h(0))
    pool.free([0, 1, 2])  # free list: 0 1 2
    pool.touch([0])  # free list: 1 2
    pool.free([0])  # free list: 1 2 0
    assert pool.allocate(3) == [1, 2, 0]
    assert pool.lookup(h(0)) is None
    assert pool.num_evictions == 1


def test_lookup_of_an_unknown_hash_is_none():
    assert BlockPool(2).lookup(h(7)) is None


# -- eviction on reuse ---------------------------------------------------------------------


def test_reuse_evicts_the_hash_and_emits_events():
    pool = BlockPool(2)
    pool.allocate(2)
    pool.cache(0, h(0))
    pool.cache(1, h(1))
    assert pool.drain_events() == ([h(0), h(1)], [])
    pool.free([1, 0])

    assert pool.allocate(1) == [1]
    assert pool.lookup(h(1)) is None
    assert pool.block_hashes[1] is None
    assert pool.lookup(h(0)) == 0
    assert pool.num_cached_blocks == 1
    assert pool.num_evictions == 1
    assert pool.drain_events() == ([], [h(1)])
    assert pool.drain_events() == ([], [])

    assert pool.allocate(1) == [0]
    assert pool.num_cached_blocks == 0
    assert pool.num_evictions == 2
    assert pool.drain_events() == ([], [h(0)])
    pool.check_integrity()


def test_reuse_of_an_uncached_block_evicts_nothing():
    pool = BlockPool(2)
    pool.allocate(2)
    pool.cache(1, h(1))
    pool.free([0, 1])
    pool.drain_events()
    assert pool.allocate(1) == [0]
    assert pool.num_evictions == 0
    assert pool.drain_events() == ([], [])


def test_reset_prefix_cache_forgets_free_blocks_only():
    pool = BlockPool(3)
    pool.allocate(3)
    for i in range(3):
        pool.cache(i, h(i))
    pool.free([0, 2])
    pool.drain_events()
    pool.reset_prefix_cache()
    assert pool.lookup(h(0)) is None
    assert pool.lookup(h(1)) == 1
    assert pool.lookup(h(2)) is None
    assert pool.num_evictions == 2
    assert pool.drain_events() == ([], [h(0), h(2)])
    assert pool.num_free_blocks == 2
    pool.check_integrity()


# -- ref counts ----------------------------------------------------------------------------


def test_shared_block_stays_used_until_its_last_reference_is_freed():
    pool = BlockPool(3)
    [block] = pool.allocate(1)
    pool.cache(block, h(0))
    pool.touch([pool.lookup(h(0))])  # a second sequence shares the block
    assert pool.ref_counts == [2, 0, 0]

    pool.free([block])
    assert pool.ref_counts == [1, 0, 0]
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [1, 2]  # block 0 is not handed out
    pool.check_integrity()

    pool.free([block])
    assert pool.ref_counts == [0, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.lookup(h(0)) == 0
    pool.check_integrity()


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    pool.free([0])
    with pytest.raises(RuntimeError, match="bug: block 0 freed more often than taken"):
        pool.free([0])
    assert pool.ref_counts == [0, 0]
    assert pool.num_free_blocks == 2
    pool.check_integrity()


def test_free_of_a_never_allocated_block_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="bug: block 1"):
        pool.free([1])


# -- cache: first writer wins --------------------------------------------------------------


def test_cache_first_writer_wins():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, h(1))
    pool.cache(b, h(1))  # same content computed twice: the index keeps the first block
    assert pool.lookup(h(1)) == a
    assert pool.block_hashes[b] is None

    pool.cache(a, h(2))  # a block already indexed keeps its first hash
    assert pool.block_hashes[a] == h(1)
    assert pool.lookup(h(2)) is None

    pool.cache(b, h(2))
    assert pool.lookup(h(2)) == b
    assert pool.num_cached_blocks == 2
    assert pool.stored_events == [h(1), h(2)]
    pool.check_integrity()


# -- check_integrity -----------------------------------------------------------------------


def test_integrity_holds_under_random_operations():
    """A shadow model predicts every allocated id and every lookup; integrity holds throughout."""
    rng = random.Random(1234)
    n = 8
    pool = BlockPool(n)
    held: list[int] = []  # one entry per reference taken
    free_order = list(range(n))  # the model's LRU free list
    index: dict[BlockHash, int] = {}  # the model's cache index
    hashes = [h(i) for i in range(6)]  # few, so writers collide
    num_hits = 0

    for _ in range(400):
        op = rng.choice(["allocate", "free", "free", "touch", "cache", "reset"])
        if op == "allocate":
            k = rng.randint(0, 3)
            if k > len(free_order):
                assert not pool.can_allocate(k)
                continue
            expected, free_order = free_order[:k], free_order[k:]
            for b in expected:
                index = {hh: bb for hh, bb in index.items() if bb != b}
            assert pool.allocate(k) == expected
            held += expected
        elif op == "free" and held:
            b = held.pop(rng.randrange(len(held)))
            pool.free([b])
            if b not in held:
                free_order.append(b)
        elif op == "touch":
            hh = rng.choice(hashes)
            assert pool.lookup(hh) == index.get(hh)
            if hh in index:
                b = index[hh]
                pool.touch([b])
                num_hits += 1
                if b in free_order:
                    free_order.remove(b)
                held.append(b)
        elif op == "cache" and held:
            b, hh = rng.choice(held), rng.choice(hashes)
            if hh not in index and b not in index.values():
                index[hh] = b
            pool.cache(b, hh)
        elif op == "reset" and rng.random() < 0.1:
            index = {hh: bb for hh, bb in index.items() if bb not in free_order}
            pool.reset_prefix_cache()
        pool.check_integrity()
        assert pool.num_free_blocks == len(free_order)
        assert pool.num_cached_blocks == len(index)
        assert sorted(b for b in range(n) for _ in range(pool.ref_counts[b])) == sorted(held)

    assert num_hits >= 10 and pool.num_evictions >= 10  # the walk did exercise hits and reuse
    for b in held:
        pool.free([b])
    pool.check_integrity()
    assert pool.num_free_blocks == n


def _used_block_with_zero_ref_count(pool: BlockPool) -> None:
    pool.ref_counts[0] = 0


def _used_block_in_free_list(pool: BlockPool) -> None:
    pool._free[0] = None


def _negative_ref_count(pool: BlockPool) -> None:
    pool.ref_counts[3] = -1


def _stale_index(pool: BlockPool) -> None:
    pool._cached[h(0)] = 1


def _hash_without_index(pool: BlockPool) -> None:
    pool.block_hashes[1] = h(9)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_used_block_with_zero_ref_count, "block 0 has ref_count 0, free=False"),
        (_used_block_in_free_list, "block 0 has ref_count 1, free=True"),
        (_negative_ref_count, "block 3 has ref_count -1"),
        (_stale_index, "cache index for block 1 is stale"),
        (_hash_without_index, "hashed blocks and cache index differ"),
    ],
)
def test_integrity_check_detects_corruption(corrupt, message):
    pool = BlockPool(4)
    pool.allocate(2)
    pool.cache(0, h(0))
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(RuntimeError, match=f"bug: {message}"):
        pool.check_integrity()


# -- hash_block ----------------------------------------------------------------------------


def test_hash_block_digest_never_changes():
    # Hard-coded: block hashes cross processes and versions (prefix indexes, KV transfer).
    first = hash_block(None, [1, 2, 3, 4], b"fp")
    assert isinstance(first, bytes)
    assert first.hex() == "d7ed7d748ab6bfcf7ee2b01a74e36486"
    assert hash_block(first, [5, 6, 7, 8], b"fp").hex() == "f9968201c7c421d7cdda40c8a06da2f9"


def test_hash_block_is_deterministic():
    assert hash_block(h(1), [10, 20], FP) == hash_block(h(1), [10, 20], FP)


def test_hash_block_chains_on_the_parent():
    tokens = [5, 6, 7, 8]
    root = hash_block(None, tokens, FP)
    assert hash_block(h(1), tokens, FP) != root
    assert hash_block(h(1), tokens, FP) != hash_block(h(2), tokens, FP)


def test_hash_block_depends_on_tokens_and_their_order():
    assert hash_block(None, [1, 2], FP) != hash_block(None, [2, 1], FP)
    assert hash_block(None, [1, 2], FP) != hash_block(None, [1, 2, 0], FP)


def test_hash_block_depends_on_the_model_fingerprint():
    assert hash_block(None, [1, 2, 3], b"model-a") != hash_block(None, [1, 2, 3], b"model-b")
