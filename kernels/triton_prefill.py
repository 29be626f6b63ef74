"""Triton paged prefill attention: packed chunks of query tokens, causal over the cache.

A program takes a tile of one sequence's query tokens times one KV head's query group
and walks the sequence's context through the block table, up to the tile's causal
bound. The chunk's own K/V are already in the cache, so chunked prefill and
prefix-cache hits need nothing special: the chunk is the sequence's last tokens.

A sliding window (``window`` > 0) starts the walk at the tile's first query's first key,
its position - window + 1, and masks each row's keys outside its own window.
"""

from __future__ import annotations

import torch

from pdserve.kernels.triton_common import (
    _LOG2E,
    _dot_dtype,
    _dot_precision,
    _jit,
    _pow2,
    _require_triton,
    tl,
)


@_jit
def _prefill_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_bts,
    stride_btb,
    stride_ot,
    stride_oh,
    stride_od,
    GROUP_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    # Program (q_tile, kv_head, seq): BLOCK_Q query tokens x GROUP_SIZE heads of one KV
    # head, flattened into BLOCK_M rows (row r = token r // GROUP_SIZE, head r % GROUP_SIZE).
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_len = seq_len - q_len  # tokens before the chunk (earlier chunks, prefix-cache hits)

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_tile * BLOCK_Q + r // GROUP_SIZE
    heads = kv_head * GROUP_SIZE + r % GROUP_SIZE
    row_mask = (r < BLOCK_Q * GROUP_SIZE) & (q_idx < q_len)
    d_mask = d < HEAD_DIM
    tokens = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        query_ptr
        + tokens[:, None] * stride_qt
        + heads[:, None] * stride_qh
        + d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q = q.to(key_cache_ptr.dtype.element_ty).to(DOT_DTYPE)  # [BLOCK_M, HEAD_DIM_PAD]
    q_pos = ctx_len + q_idx  # >= 0, so every row sees position 0: no all -inf row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    kv_end = tl.minimum(seq_len, ctx_len + (q_tile + 1) * BLOCK_Q)  # causal bound of the tile
    kv_start = 0
    if SLIDING:  # the window of the tile's first query
        kv_start = tl.maximum(ctx_len + q_tile * BLOCK_Q - window + 1, 0)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_head = key_cache_ptr + kv_head * stride_kh + d[None, :] * stride_kd
    v_head = value_cache_ptr + kv_head * stride_vh + d[None, :] * stride_vd
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        tok = tile_start + tl.arange(0, BLOCK_N)
        tok_mask = tok < kv_end
        block = tl.load(bt_row + (tok // BLOCK_SIZE) * stride_btb, mask=tok_mask, other=0)
        block = block.to(tl.int64)
        in_block = tok % BLOCK_SIZE
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_head + block[:, None] * stride_kb + in_block[:, None] * stride_kt,
            mask=kv_mask,
            other=0.0,
        )  # [BLOCK_N, HEAD_DIM_PAD]
        qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        visible = (tok[None, :] <= q_pos[:, None]) & tok_mask[None, :]
        if SLIDING:
            visible &= tok[None, :] > q_pos[:, None] - window
        qk = tl.where(visible, qk, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if SLIDING:
            # A row whose window starts past this tile has seen nothing yet: keep its
            # state at zero rather than exp2(-inf - -inf) = NaN.
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(qk - m_use[:, None])
        else:
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + block[:, None] * stride_vb + in_block[:, None] * stride_vt,
            mask=kv_mask,
            other=0.0,
        )
        p = p.to(v.dtype).to(DOT_DTYPE)
        acc = tl.dot(p, v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if SLIDING:  # a padding row past the chunk may see no key at all: 0, not 0 / 0
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


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
    ``window`` > 0 to p - window + 1..p (the blocks before the tile's window are not read).

    query: [num_tokens, num_heads, head_dim], any strides
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], any strides
    block_tables: [num_seqs, max_blocks_per_seq] int32/int64
    seq_lens: [num_seqs] int32/int64 context length including the chunk
    query_start_loc: [num_seqs + 1] int32/int64, cumulative query lengths starting at 0
    max_query_len: an upper bound of the query lengths, sizing the grid; when None,
        num_tokens (no device sync; tiles past a sequence's chunk exit at once).
    max_seq_len: unused (loop bounds are read on the device); kept for the signature.
    Returns [num_tokens, num_heads, head_dim] in query's dtype.
    """
    del max_seq_len
    _require_triton()
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = num_tokens
    group_size = num_heads // num_kv_heads
    head_dim_pad = _pow2(head_dim, 16)
    block_m = max(64, _pow2(group_size))
    block_q = block_m // group_size
    block_n = 64 if head_dim_pad <= 128 else 32
    grid = (-(-max_query_len // block_q), num_kv_heads, num_seqs)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * _LOG2E,
        window,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        GROUP_SIZE=group_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SLIDING=window > 0,
        DOT_PRECISION=_dot_precision(key_cache.dtype),
        DOT_DTYPE=_dot_dtype(key_cache.dtype),
        num_warps=4 if head_dim_pad <= 128 else 8,
        num_stages=2,
    )
    return out
