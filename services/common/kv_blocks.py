"""KV blocks as they travel between processes: their layout, keys and payloads.

Full blocks travel under their chained content hash; a prompt's partial tail block
under ``tail/<request_id>``. Every block carries the layout of the engine that made
it, and every receiver (a kvstore, a decode worker) refuses a layout that differs from
its own with ``LayoutMismatch``, whose message names each differing field.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

LAYOUT_VERSION = 1


@dataclass(frozen=True)
class BlockLayout:
    """What must agree for a block's bytes to mean the same KV in two engines."""

    version: int
    model_fingerprint: bytes
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

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
