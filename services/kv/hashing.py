"""Block identity shared by every process: the chained block hash (over the model
fingerprint of ``pdserve.core.fingerprint``).

The engine keys its prefix cache by these hashes, the kvstore stores blocks under them,
and the gateway's router computes them for a prompt to ask which worker already holds
its longest prefix; so they live here, free of torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

_ROOT = b"\x00" * 16


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], model_fingerprint: bytes
) -> BlockHash:
    """``blake2b(parent_hash, model_fingerprint, token_ids)``: never Python's ``hash()``."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or _ROOT)
    h.update(model_fingerprint)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return BlockHash(h.digest())


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, model_fingerprint: bytes
) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks, in order (the tail has none)."""
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], model_fingerprint)
        hashes.append(parent)
    return hashes
