"""BlockStore: KV blocks in memory up to a byte capacity, least recently used out first.

Pure Python, no gRPC: keys and values are ``bytes``; the ``bytes`` objects handed in
are kept as they are, never copied.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import NamedTuple

from services.common.kv_blocks import BlockLayout, LayoutMismatch

logger = logging.getLogger(__name__)


class StoredBlock(NamedTuple):
    data: bytes
    num_tokens: int
    checksum: int | None = None  # the sender's block_checksum, served back unchecked


class BlockStore:
    """Blocks of one layout, keyed by bytes, evicted least recently used first.

    The layout is fixed for the life of the store (a new model means a new kvstore): given
    at construction, or by the first put; puts and gets with another layout raise
    LayoutMismatch and change nothing.
    """

    def __init__(self, capacity_bytes: int, layout: BlockLayout | None = None) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the store's capacity must be at least 1 byte, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.layout = layout
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
        if self.layout is None:
            self.layout = layout
            logger.info("block layout fixed by the first put: %s", layout_to_text(layout))
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


def layout_to_text(layout: BlockLayout) -> str:
    """``version=1,model_fingerprint=HEX,...``: the form ``--block-layout`` reads."""
    return ",".join(
        f"{f.name}={_field_text(getattr(layout, f.name))}" for f in dataclasses.fields(layout)
    )


def _field_text(value: object) -> str:
    return value.hex() if isinstance(value, bytes) else str(value)


def layout_from_text(text: str) -> BlockLayout:
    """The layout written by ``layout_to_text``; ValueError naming what is wrong."""
    given: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--block-layout: {item!r} is not NAME=VALUE")
        given[name.strip()] = value.strip()
    fields = {f.name: f for f in dataclasses.fields(BlockLayout)}
    unknown = sorted(set(given) - set(fields))
    missing = [n for n in fields if n not in given]
    if unknown or missing:
        raise ValueError(
            f"--block-layout needs exactly the fields {','.join(fields)}"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            + (f"; missing: {', '.join(missing)}" if missing else "")
        )
    values = {}
    for name, f in fields.items():
        try:
            values[name] = _parse_field(f.type, given[name])
        except ValueError:
            raise ValueError(f"--block-layout: {name}={given[name]!r} is not a {f.type}") from None
    return BlockLayout(**values)


def _parse_field(kind: object, text: str) -> object:
    if kind in (bytes, "bytes"):
        return bytes.fromhex(text)
    if kind in (int, "int"):
        return int(text)
    return text
