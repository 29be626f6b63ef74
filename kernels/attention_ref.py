"""Plain-torch paged-attention references: the CPU path, and the ground truth for Triton kernels.

KV cache layout (per layer, as views into the engine's block-contiguous buffer):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token's slot is ``block_id * block_size + offset_in_block``. The views may be
strided across blocks (a block's layers are contiguous), so nothing here
reshapes the cache across its first two dimensions.

Sliding windows (``window`` > 0, transformers' rule): a query at position p attends keys
p - window < j <= p. Blocks wholly before a sequence's window are never read: its block
table row is shifted to start at the first block the window needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K and V into their cache slots.

    key, value: [num_tokens, num_kv_heads, head_dim]
    slot_mapping: [num_tokens] int64, slot of each token; a negative slot (a padding row)
        is skipped.
    """
    block_size = key_cache.shape[1]
    real = slot_mapping >= 0
    if not bool(real.all()):
        key, value, slot_mapping = key[real], value[real], slot_mapping[real]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


class _ContextIndex:
    """Which cache rows ``_gather_context`` copies for a set of block tables, computed once
    and reused for every layer's cache of the same shape and strides (a cache laid out
    otherwise gets its own rows)."""

    def __init__(self, cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> None:
        num_blocks, block_size, num_kv_heads, head_dim = cache.shape
        self.shape, self.strides = tuple(cache.shape), cache.stride()
        self.block_tables = block_tables
        self.num_seqs = block_tables.shape[0]
        self.max_len = max_len
        self.nb = -(-max_len // block_size)
        tables = block_tables[:, : self.nb].long()
        s_block, s_tok, s_head, s_dim = self.strides
        # When each head's [block_size, head_dim] slab of a block is contiguous and heads
        # are evenly spaced (the engine's head-major layout), every (block, head) slab is
        # one row of a strided view over the buffer, and one index_select copies them
        # straight into attention order. Other layouts take a slower but general path.
        self.slabs = (
            s_dim == 1
            and s_tok == head_dim
            and s_head >= block_size * head_dim
            and s_block % s_head == 0
        )
        if self.slabs:
            self.per_block = s_block // s_head
            heads = torch.arange(num_kv_heads, device=cache.device)
            self.rows = (tables[:, None, :] * self.per_block + heads[None, :, None]).reshape(-1)
        else:
            self.rows = tables.reshape(-1)

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """[num_seqs, num_kv_heads, max_len, head_dim] of ``cache``, contiguous."""
        if tuple(cache.shape) != self.shape or cache.stride() != self.strides:
            return _ContextIndex(cache, self.block_tables, self.max_len).gather(cache)
        num_blocks, block_size, num_kv_heads, head_dim = cache.shape
        s, nb = self.num_seqs, self.nb
        if self.slabs:
            slabs = torch.as_strided(
                cache,
                ((num_blocks - 1) * self.per_block + num_kv_heads, block_size, head_dim),
                (self.strides[2], self.strides[1], 1),
            )
            out = slabs.index_select(0, self.rows).view(s, num_kv_heads, nb * block_size, head_dim)
        else:
            out = cache.index_select(0, self.rows).view(s, nb, block_size, num_kv_heads, head_dim)
            out = out.permute(0, 3, 1, 2, 4).reshape(s, num_kv_heads, nb * block_size, head_dim)
        return out[:, :, : self.max_len]


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[num_seqs, max_blocks] block ids -> [num_seqs, num_kv_heads, max_len, head_dim], contiguous."""
    return _ContextIndex(cache, block_tables, max_len).gather(cache)


def _window_tables(
    block_tables: torch.Tensor,
    first_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    span: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``block_tables`` shifted to start at the block holding ``first_pos`` (the
    first position a sequence's window needs), ``span`` tokens of blocks wide, and the
    position of each row's first token: ([num_seqs, ceil(span / block_size)], [num_seqs]).
    Columns past a sequence's last block repeat that block (masked, as positions past its
    end): a table's entries past a sequence's blocks are stale ids, never read."""
    first_block = torch.div(first_pos, block_size, rounding_mode="floor").long()
    cols = first_block[:, None] + torch.arange(-(-span // block_size), device=first_pos.device)
    last_block = torch.div(seq_lens.long() - 1, block_size, rounding_mode="floor").clamp(min=0)
    cols = torch.minimum(cols, last_block[:, None]).clamp(max=block_tables.shape[1] - 1)
    return block_tables.gather(1, cols), first_block * block_size


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """One query token per sequence against its paged context (which includes the token itself).

    query: [num_seqs, num_heads, head_dim]
    block_tables: [num_seqs, max_blocks_per_seq] int32/int64 (entries past a sequence's blocks are ignored)
    seq_lens: [num_seqs] context length of each sequence, counting the query token.
    window: > 0 attends the last ``window`` tokens only (their blocks alone are read).
    Returns [num_seqs, num_heads, head_dim] in query's dtype.
    """
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    tables, span = block_tables, max_seq_len
    if window > 0:
        # The first needed position, len - window, lies less than a block into its block.
        span = min(max_seq_len, window + key_cache.shape[1] - 1)
        first = (seq_lens - window).clamp(min=0)
        tables, offset = _window_tables(block_tables, first, seq_lens, key_cache.shape[1], span)
    k = _gather_context(key_cache, tables, span)  # [S, Hkv, T, D]
    v = _gather_context(value_cache, tables, span)
    # GQA without repeating K/V: the query heads of a group form the rows of one matmul.
    q = query.to(k.dtype).view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [S, Hkv, G, T]
    positions = torch.arange(span, device=query.device)
    if window > 0:
        positions = offset[:, None] + positions[None, :]  # [S, T]
        hidden = (positions >= seq_lens[:, None]) | (positions < (seq_lens - window)[:, None])
    else:
        hidden = positions[None, :] >= seq_lens[:, None]
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [S, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


class PrefillPlan:
    """What every layer of a step shares in ``paged_prefill_attention``: the padded query
    rows, the mask and the cache rows to gather (``plan.matches`` says whether a plan
    still describes a call)."""

    def __init__(
        self,
        num_tokens: int,
        key_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
        window: int = 0,
    ) -> None:
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        if max_query_len is None:
            max_query_len = int(q_lens.max())
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        self.inputs = (num_tokens, block_tables, seq_lens, query_start_loc)
        self.limits = (max_query_len, max_seq_len)
        self.window = window
        device = key_cache.device
        # Pad the packed queries to [S, max_q]; row j of seq i is its token at position
        # seq_len - q_len + j.
        row = torch.arange(max_query_len, device=device)
        valid_q = row[None, :] < q_lens[:, None]  # [S, Q]
        src = (query_start_loc[:-1, None] + row[None, :]).clamp(max=max(num_tokens - 1, 0))
        self.q_shape = tuple(src.shape)
        self.src = src.reshape(-1)
        q_pos = (seq_lens - q_lens)[:, None] + row[None, :]  # [S, Q]
        tables, span = block_tables, max_seq_len
        if window > 0:
            # A chunk needs positions from first_query - window + 1: less than a block into
            # its block, so the chunk's last token is under max_q + window + block_size - 2
            # past that block's start.
            block_size = key_cache.shape[1]
            span = min(max_seq_len, max_query_len + window + block_size - 2)
            first = (seq_lens - q_lens - window + 1).clamp(min=0)
            tables, offset = _window_tables(block_tables, first, seq_lens, block_size, span)
            kv_pos = (offset[:, None] + torch.arange(span, device=device))[:, None, :]  # [S, 1, T]
        else:
            kv_pos = torch.arange(span, device=device)[None, None, :]
        mask = (kv_pos <= q_pos[:, :, None]) & (kv_pos < seq_lens[:, None, None])  # [S, Q, T]
        if window > 0:
            mask &= kv_pos > q_pos[:, :, None] - window
        # Padded query rows would see nothing; let them see the first gathered token (a
        # block the window reads) to avoid NaN.
        mask[:, :, 0] |= ~valid_q
        self.mask = mask[:, None]
        # The real rows of the padded [S * Q] output, in packed order.
        self.out_rows = valid_q.reshape(-1).nonzero().squeeze(1)
        self.context = _ContextIndex(key_cache, tables, span)

    def matches(
        self,
        num_tokens: int,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_query_len: int | None,
        max_seq_len: int | None,
        window: int = 0,
    ) -> bool:
        """Whether this plan was made for these very step tensors and window."""
        n, bt, sl, qsl = self.inputs
        return (
            n == num_tokens
            and window == self.window
            and bt is block_tables
            and sl is seq_lens
            and qsl is query_start_loc
            and max_query_len in (None, self.limits[0])
            and max_seq_len in (None, self.limits[1])
        )

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        q = query.index_select(0, self.src).view(*self.q_shape, num_heads, head_dim)  # [S, Q, H, D]
        k = self.context.gather(key_cache)
        v = self.context.gather(value_cache)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=self.mask, scale=scale, enable_gqa=True
        )  # [S, H, Q, D]
        out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [S * Q, H, D]
        return out.index_select(0, self.out_rows)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """A chunk of query tokens per sequence, packed, against the paged context, causally.

    Sequence i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; they are its
    last tokens, at positions ``seq_lens[i] - q_len_i .. seq_lens[i] - 1``. Their K/V are
    already in the cache. Token at position p attends to context positions 0..p, or with
    ``window`` > 0 to p - window + 1..p (the blocks before are not read).

    query: [num_tokens, num_heads, head_dim]
    block_tables: [num_seqs, max_blocks_per_seq]
    seq_lens: [num_seqs] context length including the chunk
    query_start_loc: [num_seqs + 1] int, cumulative query lengths starting at 0
    Returns [num_tokens, num_heads, head_dim].
    """
    plan = PrefillPlan(
        query.shape[0],
        key_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len,
        max_seq_len,
        window,
    )
    return plan.attend(query, key_cache, value_cache, scale)
