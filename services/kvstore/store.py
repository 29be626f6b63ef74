"""BlockStore: KV blocks in memory up to a byte capacity, least recently used out first.

A block nobody has fetched yet holds a lease: if no get takes it within ``lease_s`` of
its (last) put, it expires, for the decode worker it was pushed for will never ask. Once
fetched, a block is a shared prefix like any other and leaves only by LRU, unless the get
named it single-use (a request's tail block), which drops it once read. What LRU evicts
goes to ``on_evict`` (the disk tier, ``disk.py``); what expires or is dropped is dead.

Pure Python, no gRPC: keys and values are ``bytes``; the ``bytes`` objects handed in
are kept as they are, never copied.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from pdserve.kv.blocks import BlockLayout, LayoutMismatch

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

    ``lease_s``: seconds a put block waits for its first get before it expires (None: no
    lease, only LRU). Expiry happens in ``expire`` (called by every put, get and by the
    server's timer), by ``clock`` (monotonic seconds).

    ``on_evict(layout, key, block)``: called with each block LRU evicts (not those that
    expire or are dropped), e.g. to keep it in a slower tier.
    """

    def __init__(
        self,
        capacity_bytes: int,
        layout: BlockLayout | None = None,
        lease_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[BlockLayout, bytes, StoredBlock], None] | None = None,
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the store's capacity must be at least 1 byte, got {capacity_bytes}")
        if lease_s is not None and not lease_s > 0:
            raise ValueError(f"a block lease must be positive seconds or None, got {lease_s!r}")
        self.capacity_bytes = capacity_bytes
        self.layout = layout
        self.lease_s = lease_s
        self._clock = clock
        self._on_evict = on_evict
        # Least recently used first.
        self._blocks: OrderedDict[bytes, StoredBlock] = OrderedDict()
        # Blocks never fetched since their last put -> when their lease ends; soonest first
        # (every lease has the same length, and a put moves its key to the end).
        self._leases: OrderedDict[bytes, float] = OrderedDict()
        self.bytes_used = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.blocks_in = 0
        self.blocks_out = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.expired = 0  # leases that ended with no get
        self.dropped = 0  # single-use blocks dropped once read

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_leased(self) -> int:
        """Blocks put and not fetched since (each expires at the end of its lease)."""
        return len(self._leases)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def lru_order(self) -> list[bytes]:
        """Keys from least to most recently used: the next evicted comes first."""
        return list(self._blocks)

    def peek(self, key: bytes) -> StoredBlock | None:
        """The block under ``key``, its recency, lease and counters untouched."""
        return self._blocks.get(key)

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
        """Store (or replace) a block as most recently used, evicting LRU blocks to fit. A new
        block gets a lease, as does one put again before its first get; a block fetched
        before keeps none (it is a shared prefix)."""
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
        self.expire()
        old = self._blocks.pop(key, None)
        if old is not None:
            self.bytes_used -= len(old.data)
        self._make_room(len(data))
        self._blocks[key] = StoredBlock(data, num_tokens, checksum)
        if self.lease_s is not None and (old is None or key in self._leases):
            self._leases.pop(key, None)
            self._leases[key] = self._clock() + self.lease_s
        self.bytes_used += len(data)
        self.bytes_in += len(data)
        self.blocks_in += 1

    def get(self, layout: BlockLayout, key: bytes, single_use: bool = False) -> StoredBlock | None:
        """The block under ``key``, now most recently used and leased no more; None (a miss)
        if absent. ``single_use``: nobody will ask for it again, drop it now."""
        self.check_layout(layout)
        self.expire()
        block = self._blocks.get(key)
        if block is None:
            self.misses += 1
            return None
        self._leases.pop(key, None)
        if single_use:
            self._remove(key)
            self.dropped += 1
        else:
            self._blocks.move_to_end(key)
        self.hits += 1
        self.bytes_out += len(block.data)
        self.blocks_out += 1
        return block

    def promote(
        self, layout: BlockLayout, key: bytes, block: StoredBlock, single_use: bool = False
    ) -> None:
        """Count ``block``, found in a slower tier after ``get`` missed it, as served, and
        hold it again as most recently used, with no lease (a get took it): unless it is
        ``single_use`` (dropped), held already (put meanwhile), or too big for the store."""
        self.check_layout(layout)
        self.bytes_out += len(block.data)
        self.blocks_out += 1
        if single_use:
            self.dropped += 1
            return
        if key in self._blocks or len(block.data) > self.capacity_bytes:
            return
        self.expire()
        self._make_room(len(block.data))
        self._blocks[key] = block
        self.bytes_used += len(block.data)

    def _make_room(self, size: int) -> None:
        """Evict least recently used blocks until ``size`` more bytes fit."""
        while self.bytes_used + size > self.capacity_bytes:
            evicted_key, evicted = self._blocks.popitem(last=False)
            self._leases.pop(evicted_key, None)
            self.bytes_used -= len(evicted.data)
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(self.layout, evicted_key, evicted)

    def expire(self) -> int:
        """Drop the blocks whose lease has ended unfetched; how many."""
        now = self._clock()
        n = 0
        while self._leases:
            key, deadline = next(iter(self._leases.items()))
            if deadline > now:
                break
            del self._leases[key]
            self._remove(key)
            n += 1
        self.expired += n
        return n

    def _remove(self, key: bytes) -> None:
        block = self._blocks.pop(key)
        self.bytes_used -= len(block.data)

    def check_integrity(self) -> None:
        """Raise RuntimeError if the byte accounting disagrees with the blocks held (a bug)."""
        held = sum(len(b.data) for b in self._blocks.values())
        if held != self.bytes_used or held > self.capacity_bytes:
            raise RuntimeError(
                f"bug: BlockStore accounts {self.bytes_used} bytes, holds {held}, "
                f"capacity {self.capacity_bytes}"
            )
        stray = [k for k in self._leases if k not in self._blocks]
        deadlines = list(self._leases.values())
        if stray or deadlines != sorted(deadlines):
            raise RuntimeError(
                f"bug: BlockStore leases {len(stray)} blocks it does not hold, or its leases "
                "are out of order"
            )


def layout_to_text(layout: BlockLayout) -> str:
    """Every field as ``NAME=VALUE``, comma-separated (``version=...,model_fingerprint=HEX,...``):
    the form ``--block-layout`` reads."""
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
    missing = [n for n, f in fields.items() if n not in given and f.default is dataclasses.MISSING]
    if unknown or missing:
        raise ValueError(
            f"--block-layout needs exactly the fields {','.join(fields)}"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            + (f"; missing: {', '.join(missing)}" if missing else "")
        )
    values = {}
    for name, f in fields.items():
        if name not in given:  # a field added since (its default)
            continue
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
