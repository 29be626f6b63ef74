"""KV blocks as they travel between processes: their layout, keys, payloads and checksums.

Full blocks travel under their chained content hash; a prompt's partial tail block
under ``tail/<request_id>``. Every block carries the layout of the engine that made
it (its header) and a checksum of its key, token count and bytes. Every receiver (a
kvstore, a decode worker) refuses a layout that differs from its own with
``LayoutMismatch``, whose message names each differing field; a decode worker checks
each block's header, length and checksum (``block_problem``) and recomputes a block
that fails.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

try:  # ISA-L's CRC-32 (carry-less multiplies): zlib's values, ~6x its speed on x86
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover (a platform without its wheel)
    from zlib import crc32 as _crc32
from dataclasses import astuple, dataclass, field, fields

# 2: every block carries its own layout header and a CRC-32 checksum.
LAYOUT_VERSION = 2

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class BlockLayout:
    """What must agree for a block's bytes to mean the same KV in two engines."""

    version: int
    model_fingerprint: bytes
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int  # in the block
    head_dim: int
    # The block's heads are [kv_head_start, kv_head_start + num_kv_heads) of the model's
    # total_kv_heads (0 given: all of them). pdserve sends whole blocks only (a
    # tensor-parallel worker gathers and splits its ranks' heads), so a block of part of
    # the heads differs from every receiver's layout and is refused, naming these fields.
    kv_head_start: int = 0
    total_kv_heads: int = 0

    def __post_init__(self) -> None:
        if not self.total_kv_heads:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)

    def differences(self, other: BlockLayout, ours: str, theirs: str) -> list[str]:
        """One "field: <ours> X, <theirs> Y" per differing field, e.g. "block_size: ours 16,
        theirs 32" (a fingerprint shows its first 6 bytes in hex)."""

        def show(value: object) -> str:
            return value.hex()[:12] if isinstance(value, bytes) else str(value)

        return [
            f"{f.name}: {ours} {show(a)}, {theirs} {show(b)}"
            for f, a, b in zip(fields(BlockLayout), astuple(self), astuple(other), strict=True)
            if a != b
        ]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: [layers, 2, kv_heads, block_size, head_dim] values of ``dtype``."""
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KV blocks of dtype {self.dtype!r} are not supported")
        values = self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim
        return values * DTYPE_BYTES[self.dtype]


class LayoutMismatch(ValueError):
    """Blocks of another layout than the receiver's; ``str()`` names each differing field."""

    def __init__(
        self,
        have: BlockLayout,
        got: BlockLayout,
        what: str,
        ours: str,
        theirs: str,
        hint: str = "",
    ) -> None:
        diffs = "; ".join(have.differences(got, ours, theirs))
        super().__init__(f"{what} ({diffs})" + (f"; {hint}" if hint else ""))
        self.have = have
        self.got = got


@dataclass(frozen=True)
class ExportedBlock:
    """One block of a prompt's KV, ready to send (``data``: the block's bytes, or a view of
    a copy made for the export; a PutBlocks message turns it into bytes)."""

    key: bytes
    data: bytes | memoryview
    num_tokens: int


def tail_key(request_id: str) -> bytes:
    """Key of a prompt's partial last block."""
    return b"tail/" + request_id.encode()


def show_key(key: bytes) -> str:
    """A block key for a log or an error: a tail key as text, a hash as hex."""
    if key.startswith(b"tail/"):
        return key.decode(errors="replace")
    return key.hex()


def block_checksum(key: bytes, num_tokens: int, data: bytes | memoryview) -> int:
    """CRC-32 (``zlib.crc32``) of a block's key, token count and bytes: a block served under
    another key, or with another count, fails it as a damaged one does."""
    return _crc32(data, _crc32(struct.pack("<I", num_tokens), _crc32(key)))


def block_problem(
    expected: BlockLayout,
    key: bytes,
    data: bytes,
    num_tokens: int,
    header: BlockLayout | None,
    checksum: int | None,
) -> str | None:
    """Why a received block cannot be imported by an engine of layout ``expected`` (its
    header, length or checksum is wrong), or None when it can."""
    if header is None:
        return "it carries no layout header"
    if header != expected:
        return (
            "its layout header differs ("
            + "; ".join(expected.differences(header, "ours", "block's"))
            + ")"
        )
    if len(data) != expected.block_bytes:
        return f"it has {len(data)} bytes, a block of this layout has {expected.block_bytes}"
    if checksum is None:
        return "it carries no checksum"
    actual = block_checksum(key, num_tokens, data)
    if actual != checksum:
        return f"its checksum is {checksum:#010x}, its bytes give {actual:#010x}"
    return None


@dataclass(frozen=True)
class FetchedBlocks:
    """What a fetch of blocks brought: the sound blocks' bytes by key, the damaged ones (key
    -> why, never imported: recomputed), and the keys the kvstore did not have."""

    found: dict[bytes, bytes] = field(default_factory=dict)
    rejected: dict[bytes, str] = field(default_factory=dict)
    missing: list[bytes] = field(default_factory=list)
    # Called once the blocks are imported (or given up): a NIXL read's buffer slots.
    _on_done: list[Callable[[], object]] = field(default_factory=list, repr=False)

    def merge(self, other: FetchedBlocks) -> None:
        """Add ``other``'s blocks (a fetch from another replica) to these."""
        self.found.update(other.found)
        self.rejected.update(other.rejected)
        self.missing.extend(other.missing)
        self._on_done.extend(other._on_done)

    def on_done(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` when ``done()`` is called: ``found`` is not read after it."""
        self._on_done.append(fn)

    def done(self) -> None:
        """The blocks' bytes are no longer needed (imported, or given up)."""
        callbacks = list(self._on_done)
        self._on_done.clear()
        for fn in callbacks:
            fn()
