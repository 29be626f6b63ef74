"""BlockStore: KV blocks in memory up to a byte capacity, least recently used out first.

Pure Python, no gRPC: keys and values are ``bytes``; the ``bytes`` objects handed in
are kept as they are, never copied.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from services.common.kv_blocks import BlockLayout, LayoutMismatch


class StoredBlock(NamedTuple):
    data: bytes
    num_tokens: int
    checksum: int | None = None  # the sender's block_checksum, served back unchecked


class BlockStore:
    """Blocks of one layout, keyed by bytes, evicted least recently used first.

    The first put fixes the layout for the life of the store (a new model means a
    new kvstore); puts and gets with another layout raise LayoutMismatch.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the store's capacity must be at least 1 byte, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.layout: BlockLayout | None = None
        # Least recently used first.
        self._blocks: OrderedDict[bytes, StoredBlock] = OrderedDict()
        self.bytes_used = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.blocks_in = 0
        self.blocks_out = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def lru_order(self) -> list[bytes]:
        """Keys from least to most recently used: the next evicted comes first."""
        return list(self._blocks)

    def check_layout(self, layout: BlockLayout) -> None:
        """Raise LayoutMismatch if the store holds another layout; fixes nothing."""
        if self.layout is not None and layout != self.layout:
            raise LayoutMismatch(
                self.layout,
                layout,
                "block layout mismatch: the kvstore holds blocks of another model or KV layout",
                "store",
                "request",
            )

    def put(
        self,
        layout: BlockLayout,
        key: bytes,
        data: bytes,
        num_tokens: int,
        checksum: int | None = None,
    ) -> None:
        """Store (or replace) a block as most recently used, evicting LRU blocks to fit."""
        self.check_layout(layout)
        if not key:
            raise ValueError("every block needs a non-empty key")
        if len(data) > self.capacity_bytes:
            raise ValueError(
                f"a block of {len(data)} bytes does not fit in the store's capacity of "
                f"{self.capacity_bytes} bytes: raise --capacity-bytes"
            )
        self.layout = layout
        old = self._blocks.pop(key, None)
        if old is not None:
            self.bytes_used -= len(old.data)
        while self.bytes_used + len(data) > self.capacity_bytes:
            _, evicted = self._blocks.popitem(last=False)
            self.bytes_used -= len(evicted.data)
            self.evictions += 1
        self._blocks[key] = StoredBlock(data, num_tokens, checksum)
        self.bytes_used += len(data)
        self.bytes_in += len(data)
        self.blocks_in += 1

    def get(self, layout: BlockLayout, key: bytes) -> StoredBlock | None:
        """The block under ``key``, now most recently used; None (a miss) if absent."""
        self.check_layout(layout)
        block = self._blocks.get(key)
        if block is None:
            self.misses += 1
            return None
        self._blocks.move_to_end(key)
        self.hits += 1
        self.bytes_out += len(block.data)
        self.blocks_out += 1
        return block

    def check_integrity(self) -> None:
        """Raise RuntimeError if the byte accounting disagrees with the blocks held (a bug)."""
        held = sum(len(b.data) for b in self._blocks.values())
        if held != self.bytes_used or held > self.capacity_bytes:
            raise RuntimeError(
                f"bug: BlockStore accounts {self.bytes_used} bytes, holds {held}, "
                f"capacity {self.capacity_bytes}"
            )
