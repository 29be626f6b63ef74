"""Per-sequence block allocation over a BlockPool, with prefix-cache lookups.

For a model whose every layer attends over a sliding window (``window``: the widest of
them), a sequence's blocks that have left the window are released as it goes: a block
whose last position lies before the first key the next query can see is given back
(``num_released_blocks`` leading entries of the block table). The table keeps their ids so
that positions still map to table entries; the attention kernels never read below the
window, so a released block reused by another sequence is never seen through this one.
Prefill-only sequences keep theirs: a prefill worker exports the whole prompt.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.sequence import Sequence
from pdserve.kv.hashing import BlockHash, hash_block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Gives sequences the blocks they need and finds the prefix they can reuse."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        model_fingerprint: bytes,
        enable_prefix_caching: bool = True,
        window: int = 0,
    ) -> None:
        self.pool = pool
        self.window = window  # 0: some layer sees the whole context, every block stays
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found in the cache
        self._num_cached_blocks: dict[str, int] = {}

    def update_block_hashes(self, seq: Sequence) -> list[BlockHash]:
        """Extend ``seq.block_hashes`` to cover all its full blocks of known tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(
                hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], self.model_fingerprint)
            )
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq`` (at least one token is left to compute)."""
        if not self.enable_prefix_caching:
            return []
        hashes = self.update_block_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted sequence's prefix-cache lookup."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens (after ``computed_blocks``).

        Returns False, changing nothing, when the pool cannot supply them.
        """
        computed_blocks = computed_blocks or []
        self.release_out_of_window(seq)
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        need = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = need - len(seq.block_table) - len(computed_blocks)
        # Hit blocks that sit in the free list stop being allocatable once touched.
        num_revived = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            seq.block_table.extend(computed_blocks)
            self._num_cached_blocks[seq.request_id] = len(seq.block_table)
        if num_new_blocks > 0:
            seq.block_table.extend(self.pool.allocate(num_new_blocks))
        return True

    def release_out_of_window(self, seq: Sequence) -> int:
        """Give back the blocks of ``seq`` that its next query (at ``num_computed_tokens``)
        and every later one cannot see; how many this call released."""
        if not self.window or seq.prefill_only or not seq.num_computed_tokens:
            return 0
        first_seen = seq.num_computed_tokens - self.window + 1
        upto = min(max(first_seen, 0) // self.block_size, len(seq.block_table))
        done = seq.num_released_blocks
        if upto <= done:
            return 0
        self.pool.free(seq.block_table[done:upto])
        seq.num_released_blocks = upto
        return upto - done

    def blocks_held(self, seq: Sequence) -> int:
        """Blocks ``seq`` holds now (its table less those released)."""
        return len(seq.block_table) - seq.num_released_blocks

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past those ``seq``'s tokens need (their slots held rejected
        drafts' KV only), last first."""
        keep = cdiv(seq.num_tokens, self.block_size)
        if len(seq.block_table) > keep:
            self.pool.free(reversed(seq.block_table[keep:]))
            del seq.block_table[keep:]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Index the blocks that ``seq`` has filled with computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(seq.request_id, 0)
        if num_full <= start:
            return
        hashes = self.update_block_hashes(seq)
        for i in range(start, num_full):
            self.pool.cache(seq.block_table[i], hashes[i])
        self._num_cached_blocks[seq.request_id] = num_full

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Hold the cached blocks of ``seq``'s longest cached prefix as its first blocks, before
        it is scheduled (a request whose KV comes from elsewhere); returns how many."""
        hits = self.get_computed_blocks(seq)
        self.pool.touch(hits)
        seq.block_table = list(hits)
        self._num_cached_blocks[seq.request_id] = len(hits)
        return len(hits)

    def import_blocks(
        self,
        seq: Sequence,
        blocks: list[tuple[bytes, BlockHash | None]],
        write: Callable[[list[tuple[int, bytes]]], None],
    ) -> bool:
        """Append blocks whose KV another engine computed to ``seq``'s table: each gets a free
        block, all filled by one ``write([(block_id, data), ...])``; one with a hash joins
        the prefix cache (a prompt's partial tail has none and comes last).

        Returns False, changing nothing, when the pool has too few free blocks; a failing
        ``write`` frees what this call took and raises.
        """
        if len(blocks) > self.pool.num_free_blocks:
            return False
        new = self.pool.allocate(len(blocks))
        try:
            write([(block_id, data) for block_id, (data, _) in zip(new, blocks, strict=True)])
        except BaseException:
            self.pool.free(new)
            raise
        for block_id, (_, block_hash) in zip(new, blocks, strict=True):
            if block_hash is not None and self.enable_prefix_caching:
                self.pool.cache(block_id, block_hash)
        seq.block_table.extend(new)
        hashed = sum(h is not None for _, h in blocks) if self.enable_prefix_caching else 0
        self._num_cached_blocks[seq.request_id] = len(seq.block_table) - len(new) + hashed
        return True

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first, so that its prefix stays cached longest."""
        self.pool.free(reversed(seq.block_table[seq.num_released_blocks :]))
        seq.block_table = []
        seq.num_released_blocks = 0
        self._num_cached_blocks.pop(seq.request_id, None)
