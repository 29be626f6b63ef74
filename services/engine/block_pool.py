"""A fixed pool of KV blocks with reference counts, an LRU free list and a prefix-cache index.

No torch here: block ids are plain ints; the model runner owns the tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pdserve.kv.hashing import BlockHash


class BlockPool:
    """``num_blocks`` blocks; a freed block keeps its contents and hash until it is reused.

    Free blocks form an LRU list: the block freed longest ago is reused first. A
    block is in exactly one of two states: free (ref_count 0, in the free list) or
    used (ref_count > 0). A cached block may be in either.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0
        # Hashes stored and evicted since the last drain_events(), for a prefix index;
        # An engine turns recording off until someone reads them (a worker that
        # publishes to a registry), so that unread events do not pile up.
        self.record_events = True
        self.stored_events: list[BlockHash] = []
        self.evicted_events: list[BlockHash] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, least recently freed first, evicting their cached hashes."""
        if n > len(self._free):
            raise RuntimeError(f"bug: allocate({n}) with {len(self._free)} free blocks")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            ids.append(block_id)
        return ids

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding this content, if cached."""
        return self._cached.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference to cached blocks (a prefix-cache hit)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop a reference to each block; unreferenced ones join the free list's tail in order."""
        for block_id in block_ids:
            rc = self.ref_counts[block_id] - 1
            if rc < 0:
                raise RuntimeError(f"bug: block {block_id} freed more often than taken")
            self.ref_counts[block_id] = rc
            if rc == 0:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Index a full, computed block by its content hash (first writer wins)."""
        if self.block_hashes[block_id] is not None or block_hash in self._cached:
            return
        self.block_hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self.record_events:
            self.stored_events.append(block_hash)

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            self.block_hashes[block_id] = None
            del self._cached[block_hash]
            self.num_evictions += 1
            if self.record_events:
                self.evicted_events.append(block_hash)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash of free blocks (used blocks keep theirs)."""
        for block_id in list(self._free):
            self._evict(block_id)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the prefix cache holds now."""
        return list(self._cached)

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """Stored and evicted hashes since the last call (turns recording on)."""
        self.record_events = True
        stored, evicted = self.stored_events, self.evicted_events
        self.stored_events, self.evicted_events = [], []
        return stored, evicted

    def check_integrity(self) -> None:
        """Raise if the bookkeeping is inconsistent (a bug, never a user error)."""
        free = set(self._free)
        for block_id, rc in enumerate(self.ref_counts):
            if rc < 0 or (rc == 0) != (block_id in free):
                raise RuntimeError(
                    f"bug: block {block_id} has ref_count {rc}, free={block_id in free}"
                )
        for block_hash, block_id in self._cached.items():
            if self.block_hashes[block_id] != block_hash:
                raise RuntimeError(f"bug: cache index for block {block_id} is stale")
        if sum(h is not None for h in self.block_hashes) != len(self._cached):
            raise RuntimeError("bug: hashed blocks and cache index differ in size")
