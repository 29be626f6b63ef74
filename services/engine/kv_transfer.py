"""Moving a request's KV blocks between engines: export after prefill, import before decode.

Full blocks travel under their chained content hash; a prompt's partial tail block
under ``tail/<request_id>``. Every block carries the layout of the engine that made
it, and an engine refuses a layout that differs from its own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from services.engine.block_pool import BlockHash

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

    def mismatch(self, other: BlockLayout) -> str | None:
        """None when equal; else which fields differ, e.g. "block_size: ours 16, theirs 32"."""
        diffs = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                if isinstance(mine, bytes):
                    mine, theirs = mine.hex()[:12], theirs.hex()[:12]
                diffs.append(f"{f.name}: ours {mine}, theirs {theirs}")
        return "; ".join(diffs) or None


@dataclass(frozen=True)
class ExportedBlock:
    """One block of a prompt's KV, ready to send."""

    key: bytes
    data: bytes
    num_tokens: int


def tail_key(request_id: str) -> bytes:
    """Key of a prompt's partial last block."""
    return b"tail/" + request_id.encode()


def prompt_block_keys(
    hashes: list[BlockHash], num_prompt_tokens: int, block_size: int, request_id: str
) -> list[bytes]:
    """Keys of the blocks holding a prompt: its full blocks' hashes, then the tail's key."""
    keys = [bytes(h) for h in hashes[: num_prompt_tokens // block_size]]
    if num_prompt_tokens % block_size:
        keys.append(tail_key(request_id))
    return keys
