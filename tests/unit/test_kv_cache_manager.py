"""KVCacheManager on the CPU with tiny blocks: exact block tables, hits and eviction order."""

from __future__ import annotations

import pytest

from pdserve.core.sampling import SamplingParams
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.sequence import Sequence
from pdserve.kv.hashing import hash_block

FP = b"fp"
BS = 4


def manager(num_blocks: int, block_size: int = BS, prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), block_size, FP, prefix_caching)


def seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id, list(token_ids), SamplingParams())


def compute(kv: KVCacheManager, s: Sequence, n: int, hits: list[int] | None = None) -> None:
    """Admit or advance ``s`` by ``n`` tokens the way the scheduler and runner do."""
    assert kv.allocate_slots(s, n, hits)
    s.num_computed_tokens += len(hits or []) * kv.block_size + n
    kv.cache_full_blocks(s)


# -- allocate_slots ------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens, num_blocks", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_allocate_slots_takes_ceil_tokens_over_block_size(num_tokens, num_blocks):
    kv = manager(8)
    s = seq("a", range(num_tokens))
    assert kv.allocate_slots(s, num_tokens)
    assert s.block_table == list(range(num_blocks))
    assert kv.pool.num_free_blocks == 8 - num_blocks


def test_allocate_slots_adds_blocks_only_when_a_block_fills():
    kv = manager(8)
    s = seq("a", range(5))
    compute(kv, s, 5)
    assert s.block_table == [0, 1]
    s.append_token(100)
    s.append_token(101)
    s.append_token(102)
    assert kv.allocate_slots(s, 3)  # tokens 5..7 fit in block 1
    assert s.block_table == [0, 1]
    s.append_token(103)
    assert kv.allocate_slots(s, 4)  # token 8 opens block 2
    assert s.block_table == [0, 1, 2]


def test_allocate_slots_refuses_and_changes_nothing_when_short():
    kv = manager(3)
    s = seq("a", range(13))  # 4 blocks
    assert not kv.allocate_slots(s, 13)
    assert s.block_table == []
    assert kv.pool.ref_counts == [0, 0, 0]
    assert kv.pool.num_free_blocks == 3
    assert kv.allocate_slots(s, 12)  # a 12-token chunk fits
    assert s.block_table == [0, 1, 2]


def _cached_prefix(kv: KVCacheManager) -> Sequence:
    """A 9-token sequence computed in blocks 0 1 2, with blocks 0 and 1 cached."""
    a = seq("a", range(9))
    compute(kv, a, 9)
    assert a.block_table == [0, 1, 2]
    assert kv.pool.num_cached_blocks == 2
    return a


def test_hit_blocks_on_the_free_list_count_against_free_blocks():
    kv = manager(4)
    kv.free(_cached_prefix(kv))  # free list: 3 2 1 0
    c = seq("c", [50, 51, 52, 53])
    compute(kv, c, 4)
    assert c.block_table == [3]  # free list: 2 1 0, blocks 0 and 1 still cached

    b = seq("b", [*range(8), 60, 61, 62, 63, 64, 65, 66, 67])  # 16 tokens, 4 blocks
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    # 2 new blocks + 2 revived hits > 3 free blocks: allocating would evict a hit.
    assert not kv.allocate_slots(b, 8, hits)
    assert b.block_table == []
    assert kv.pool.ref_counts == [0, 0, 0, 1]
    assert kv.pool.num_free_blocks == 3
    assert kv.pool.lookup(b.block_hashes[0]) == 0
    assert kv.pool.lookup(b.block_hashes[1]) == 1
    kv.pool.check_integrity()

    kv.free(c)  # free list: 2 1 0 3
    assert kv.allocate_slots(b, 8, hits)
    assert b.block_table == [0, 1, 2, 3]
    assert kv.pool.ref_counts == [1, 1, 1, 1]
    kv.pool.check_integrity()


def test_hit_blocks_in_use_cost_no_free_blocks():
    kv = manager(4)
    a = _cached_prefix(kv)  # a keeps blocks 0 1 2; free list: 3
    b = seq("b", [*range(8), 70, 71, 72, 73])  # 12 tokens: 2 hit blocks + 1 new
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    assert kv.allocate_slots(b, 4, hits)
    assert b.block_table == [0, 1, 3]
    assert kv.pool.ref_counts == [2, 2, 1, 1]
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 4
    kv.pool.check_integrity()


# -- prefix hits ---------------------------------------------------------------------------


def test_prefix_hits_follow_the_shared_prefix_only():
    kv = manager(8)
    a = seq("a", range(13))
    compute(kv, a, 13)  # blocks 0 1 2 cached
    b = seq("b", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])  # differs in block 1
    assert kv.get_computed_blocks(b) == [0]


def test_prefix_hits_stop_at_the_first_miss():
    kv = manager(8)
    s = seq("s", range(13))
    h0, h1, h2 = kv.update_block_hashes(s)
    assert kv.pool.allocate(3) == [0, 1, 2]
    kv.pool.cache(0, h0)
    kv.pool.cache(2, h2)  # block 2's content is cached but block 1's is not
    assert kv.get_computed_blocks(s) == [0]


def test_block_hashes_chain_over_full_blocks_only():
    kv = manager(8)
    s = seq("s", range(11))
    hashes = kv.update_block_hashes(s)
    assert s.block_hashes is hashes
    assert hashes == [
        hash_block(None, [0, 1, 2, 3], FP),
        hash_block(hashes[0], [4, 5, 6, 7], FP),
    ]
    s.append_token(11)
    assert kv.update_block_hashes(s)[2] == hash_block(hashes[1], [8, 9, 10, 11], FP)


def test_fully_cached_prompt_still_computes_one_token():
    kv = manager(4, block_size=16)
    a = seq("a", range(32))
    compute(kv, a, 32)
    assert a.block_table == [0, 1]
    assert kv.pool.num_cached_blocks == 2

    b = seq("b", range(32))
    hits = kv.get_computed_blocks(b)
    assert hits == [0]  # not [0, 1]: the last token must run to give logits
    assert kv.allocate_slots(b, 16, hits)
    assert b.block_table == [0, 2]

    c = seq("c", range(33))
    assert kv.get_computed_blocks(c) == [0, 1]


def test_prefix_caching_disabled_neither_caches_nor_hits():
    kv = manager(4, prefix_caching=False)
    a = seq("a", range(9))
    compute(kv, a, 9)
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(seq("b", range(9))) == []


# -- cache_full_blocks ---------------------------------------------------------------------


def test_cache_full_blocks_registers_fully_computed_blocks_only():
    kv = manager(8)
    s = seq("s", range(10))
    compute(kv, s, 6)  # block 0 full, block 1 half computed
    assert s.block_table == [0, 1]
    h0, h1 = s.block_hashes
    assert kv.pool.block_hashes[:2] == [h0, None]

    compute(kv, s, 4)  # 10 tokens: blocks 0 1 full, block 2 half
    assert s.block_table == [0, 1, 2]
    assert kv.pool.block_hashes[:3] == [h0, h1, None]

    s.append_token(100)
    compute(kv, s, 1)  # 11 computed, 11 known
    s.append_token(101)
    assert kv.pool.block_hashes[2] is None  # token 11 is known but not computed
    compute(kv, s, 1)
    h2 = hash_block(h1, [8, 9, 100, 101], FP)
    assert kv.pool.block_hashes[:3] == [h0, h1, h2]
    assert kv.pool.drain_events() == ([h0, h1, h2], [])


def test_cache_full_blocks_resumes_after_hit_blocks():
    kv = manager(8)
    a = seq("a", range(9))
    compute(kv, a, 9)  # blocks 0 1 cached
    kv.pool.drain_events()
    b = seq("b", [*range(8), 8, 9, 10, 11, 12])
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    compute(kv, b, 5, hits)  # 13 computed: blocks 0 1 2 full
    assert b.block_table == [0, 1, 3, 4]
    assert kv.pool.drain_events() == ([b.block_hashes[2]], [])
    assert kv.pool.lookup(b.block_hashes[2]) == 3


# -- free ----------------------------------------------------------------------------------


def test_free_releases_tail_first_so_the_prefix_is_evicted_last():
    kv = manager(6)
    a = seq("a", range(13))
    compute(kv, a, 13)  # blocks 0 1 2 cached, block 3 (one token) not
    assert a.block_table == [0, 1, 2, 3]
    b = seq("b", range(100, 104))
    compute(kv, b, 4)
    assert b.block_table == [4]
    kv.pool.drain_events()

    kv.free(a)  # free list: 5 3 2 1 0
    assert a.block_table == []
    assert kv.pool.ref_counts == [0, 0, 0, 0, 1, 0]

    assert kv.pool.allocate(3) == [5, 3, 2]
    assert kv.pool.drain_events() == ([], [a.block_hashes[2]])
    assert kv.get_computed_blocks(seq("a2", range(13))) == [0, 1]
    assert kv.pool.allocate(1) == [1]
    assert kv.get_computed_blocks(seq("a3", range(13))) == [0]
    kv.pool.check_integrity()


def test_free_of_a_shared_prefix_keeps_it_for_the_other_sequence():
    kv = manager(4)
    a = _cached_prefix(kv)
    b = seq("b", [*range(8), 7, 7, 7, 7])
    hits = kv.get_computed_blocks(b)
    compute(kv, b, 4, hits)
    assert b.block_table == [0, 1, 3]
    kv.free(a)
    assert kv.pool.ref_counts == [1, 1, 0, 1]
    assert kv.pool.allocate(1) == [2]
    kv.pool.check_integrity()


# -- counters ------------------------------------------------------------------------------


def test_record_lookup_counts_tokens_and_hits():
    kv = manager(4)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    kv.record_lookup(32, 16)
    kv.record_lookup(10, 0)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (42, 16)


# -- imports: a prefix held from the cache, then blocks computed elsewhere ---------------------


def test_take_cached_prefix_holds_the_cached_blocks_of_a_request_prefilled_elsewhere():
    kv = manager(8)
    a = seq("a", range(12))
    compute(kv, a, 12)  # blocks 0, 1, 2 cached (block 2 holds tokens 8..11)
    kv.free(a)
    b = seq("b", [*range(8), 50, 51, 52, 53])
    b.append_token(7)  # the first token, sampled by the prefill worker
    assert kv.take_cached_prefix(b) == 2
    assert b.block_table == [0, 1]
    assert kv.pool.ref_counts[:3] == [1, 1, 0]
    assert kv.pool.num_free_blocks == 6


def test_import_blocks_writes_caches_and_appends_the_blocks():
    kv = manager(6)
    s = seq("a", range(10))  # 2 full blocks and a tail of 2
    s.append_token(99)
    written = {}
    hashes = kv.update_block_hashes(s)
    blocks = [(b"b0", hashes[0]), (b"b1", hashes[1]), (b"tail", None)]
    assert kv.import_blocks(s, blocks, written.update)
    assert s.block_table == [0, 1, 2]
    assert written == {0: b"b0", 1: b"b1", 2: b"tail"}
    assert [kv.pool.lookup(h) for h in hashes[:2]] == [0, 1]  # the full ones are cached
    assert kv.pool.block_hashes[2] is None
    kv.free(s)
    kv.pool.check_integrity()


def test_import_blocks_refuses_without_room_and_frees_what_a_failing_write_took():
    kv = manager(2)
    s = seq("a", range(12))
    blocks = [(b"x", None)] * 3
    assert not kv.import_blocks(s, blocks, lambda pairs: None)
    assert s.block_table == [] and kv.pool.num_free_blocks == 2

    def failing(pairs: list[tuple[int, bytes]]) -> None:
        raise ValueError("block data has 1 bytes, this worker's blocks have 64")

    with pytest.raises(ValueError, match="block data"):
        kv.import_blocks(s, blocks[:2], failing)
    assert s.block_table == [] and kv.pool.num_free_blocks == 2
    kv.pool.check_integrity()
