"""Sliding-window attention for the kernel tests: the windows to try against a block size, the
dense truth (softmax attention over a sequence's contiguous K/V with an explicit mask), and
NaN in every cache block a window leaves out, so that a kernel that reads such a block (even
to mask it: NaN times a zero weight is NaN) returns NaN."""

from __future__ import annotations

import torch


def windows(block_size: int) -> dict[str, int]:
    """Test id -> window: one token, under a block, several blocks but not a whole number of
    them, and more than any test's context."""
    return {
        "w1": 1,
        "under-a-block": block_size // 2 + 1,
        "2.5-blocks": 2 * block_size + block_size // 2 + 1,
        "past-the-context": 100_000,
    }


def disjoint_tables(
    seq_lens: list[int], block_size: int, gen: torch.Generator
) -> tuple[int, list[list[int]]]:
    """Blocks for a batch, and each sequence's block table: disjoint shuffled blocks, each
    row padded with one spare block that no sequence owns (it stays finite when the blocks
    before the windows are poisoned). Returns (number of blocks, tables)."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spare, start, tables = perm.pop(), 0, []
    for nb in needed:
        tables.append(perm[start : start + nb] + [spare] * (max(needed) - nb))
        start += nb
    return num_blocks, tables


def first_needed(seq_lens: list[int], q_lens: list[int], window: int) -> list[int]:
    """The first position each sequence's chunk attends: its first query's, less window - 1."""
    return [max(0, n - m - window + 1) for n, m in zip(seq_lens, q_lens, strict=True)]


def poison_before(
    caches: tuple[torch.Tensor, ...],
    tables: list[list[int]],
    first: list[int],
    rows: bool = False,
) -> int:
    """NaN in each sequence's blocks that lie wholly before its position ``first[i]``, in
    every cache of ``caches`` ([num_blocks, block_size, ...]); ``rows``: in the rows before
    it in its own block too (for kernels that start a token, not a block, in). Returns how
    many blocks (whole or in part) were poisoned."""
    block_size = caches[0].shape[1]
    count = 0
    for table, f in zip(tables, first, strict=True):
        whole = table[: f // block_size]
        for cache in caches:
            cache[whole] = float("nan")
            if rows and f % block_size:
                cache[table[f // block_size], : f % block_size] = float("nan")
        count += len(whole) + int(rows and f % block_size > 0)
    return count


def context(cache: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    """A sequence's first n tokens, read block by block into one tensor: [n, kv_heads, dim]."""
    return torch.cat([cache[b] for b in table])[:n]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """q: [Q, H, D] at positions q_pos; k, v: [T, Hkv, D] at positions 0..T-1. Query p sees
    keys p - window < j <= p (window 0: 0 <= j <= p). Returns [Q, H, D] in fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,thd->hqt", q.float(), k) * scale
    t = torch.arange(k.shape[0], device=k.device)[None, :]
    hidden = t > q_pos[:, None]
    if window > 0:
        hidden |= t <= q_pos[:, None] - window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hqt,thd->qhd", scores.softmax(-1), v)


def dense_paged(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: list[list[int]],
    seq_lens: list[int],
    q_lens: list[int],
    scale: float,
    window: int,
) -> torch.Tensor:
    """``dense_attention`` of each sequence's packed queries (its last q_len positions)
    against its context, read through its block table: [num_tokens, H, D] in fp32."""
    outs, row = [], 0
    for table, n, m in zip(tables, seq_lens, q_lens, strict=True):
        k, v = context(key_cache, table, n), context(value_cache, table, n)
        q_pos = torch.arange(n - m, n, device=query.device)
        outs.append(dense_attention(query[row : row + m], k, v, q_pos, scale, window))
        row += m
    return torch.cat(outs)
