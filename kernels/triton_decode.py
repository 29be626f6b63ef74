"""Triton split-K paged decode attention: one query token per sequence.

Each sequence's context is cut into splits of a fixed number of tokens; a program
attends one KV head's query group over one split, and a second kernel merges the
splits' partial softmaxes. With a single split the first kernel writes the output
itself. ``decode_split_plan`` chooses the split count and size.

A sliding window (``window`` > 0) shifts a sequence's splits to start at its first token
in the window, len - window: the tokens before are neither read nor counted in the plan.
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

# Decode split-K: a split covers a fixed number of context tokens, so a sequence's
# result depends on its own length only, not on the batch it is in (up to
# DECODE_MAX_SPLITS * DECODE_SPLIT_TOKENS tokens, past which splits grow).
DECODE_SPLIT_TOKENS = 256
DECODE_MAX_SPLITS = 64


@_jit
def _decode_split_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    qk_scale,
    window,
    tokens_per_split,
    num_splits,
    num_heads,
    stride_qs,
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
    stride_os,
    stride_oh,
    stride_od,
    GROUP_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    # Program (seq, kv_head, split): all GROUP_SIZE query heads of one KV head against
    # context tokens [first + split * tokens_per_split, +tokens_per_split) of one sequence,
    # first its first token in the window (0 without one).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * tokens_per_split
    if SLIDING:
        start += tl.maximum(seq_len - window, 0)
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP_SIZE + g
    g_mask = g < GROUP_SIZE
    d_mask = d < HEAD_DIM
    q = tl.load(
        query_ptr
        + seq.to(tl.int64) * stride_qs
        + heads[:, None] * stride_qh
        + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q = q.to(key_cache_ptr.dtype.element_ty).to(DOT_DTYPE)  # [GROUP_PAD, HEAD_DIM_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_head = key_cache_ptr + kv_head * stride_kh + d[None, :] * stride_kd
    v_head = value_cache_ptr + kv_head * stride_vh + d[None, :] * stride_vd
    for tile_start in range(start, end, TILE_N):
        tok = tile_start + tl.arange(0, TILE_N)
        tok_mask = tok < end
        block = tl.load(bt_row + (tok // BLOCK_SIZE) * stride_btb, mask=tok_mask, other=0)
        block = block.to(tl.int64)
        in_block = tok % BLOCK_SIZE
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_head + block[:, None] * stride_kb + in_block[:, None] * stride_kt,
            mask=kv_mask,
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]
        qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(tok_mask[None, :], qk, float("-inf"))  # [GROUP_PAD, TILE_N]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
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

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len 0 (padding row) -> zeros
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr
            + seq.to(tl.int64) * stride_os
            + heads[:, None] * stride_oh
            + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partials: m, l [num_seqs, num_heads, num_splits]; acc [..., HEAD_DIM], all fp32.
        row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)


@_jit
def _decode_reduce_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    num_splits,
    num_heads,
    stride_os,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    # Program (seq, head): merges the head's num_splits partial softmaxes.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    row = (seq.to(tl.int64) * num_heads + head) * num_splits + s  # [SPLITS_PAD]
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l_part = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # every split empty: seq_len 0
    w = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [SPLITS_PAD, HEAD_DIM_PAD]
    total_l = tl.sum(l_part * w, 0)
    total_l = tl.where(total_l > 0.0, total_l, 1.0)
    out = tl.sum(acc * w[:, None], 0) / total_l
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def _decode_tile(head_dim_pad: int) -> int:
    return 64 if head_dim_pad <= 128 else 32


def decode_split_plan(
    max_seq_len: int, head_dim: int, num_splits: int | None = None
) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for a decode batch whose longest context is max_seq_len.

    A split is a whole number of TILE_N-token tiles; by default DECODE_SPLIT_TOKENS tokens,
    more when max_seq_len would need over DECODE_MAX_SPLITS splits.
    """
    tile_n = _decode_tile(_pow2(head_dim, 16))
    max_seq_len = max(max_seq_len, 1)
    if num_splits is None:
        tokens = DECODE_SPLIT_TOKENS
        if -(-max_seq_len // tokens) > DECODE_MAX_SPLITS:
            tokens = -(-max_seq_len // DECODE_MAX_SPLITS)
    else:
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        tokens = -(-max_seq_len // num_splits)
    tokens = -(-tokens // tile_n) * tile_n
    return -(-max_seq_len // tokens), tokens


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    window: int = 0,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query token per sequence against its paged context (which includes the token itself).

    query: [num_seqs, num_heads, head_dim], any strides
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], any strides
    block_tables: [num_seqs, max_blocks_per_seq] int32/int64 (entries past a sequence's blocks are ignored)
    seq_lens: [num_seqs] int32/int64 context length of each sequence, counting the query token.
    max_seq_len: an upper bound of seq_lens, used only to size the split-K grid; when None,
        block_tables.shape[1] * block_size (no device sync). A sequence longer than it is
        an error that goes unnoticed: its tail is ignored.
    window: > 0 attends each sequence's last ``window`` tokens only (the blocks before are
        not read); the splits then cover min(max_seq_len, window) tokens.
    num_splits: override of the number of context splits (tests, tuning).
    Returns [num_seqs, num_heads, head_dim] in query's dtype.
    """
    _require_triton()
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    group_size = num_heads // num_kv_heads
    head_dim_pad = _pow2(head_dim, 16)
    tile_n = _decode_tile(head_dim_pad)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    span = min(max_seq_len, window) if window > 0 else max_seq_len
    splits, tokens_per_split = decode_split_plan(span, head_dim, num_splits)

    if splits == 1:
        part_m = part_l = part_acc = out  # unused
    else:
        part_m = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=query.device
        )
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        part_m,
        part_l,
        part_acc,
        scale * _LOG2E,
        window,
        tokens_per_split,
        splits,
        num_heads,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        GROUP_SIZE=group_size,
        GROUP_PAD=_pow2(group_size, 16),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        SINGLE_SPLIT=splits == 1,
        SLIDING=window > 0,
        DOT_PRECISION=_dot_precision(key_cache.dtype),
        DOT_DTYPE=_dot_dtype(key_cache.dtype),
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        splits_pad = _pow2(splits)
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            splits,
            num_heads,
            *out.stride(),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=splits_pad,
            num_warps=4 if splits_pad * head_dim_pad <= 4096 else 8,
        )
    return out
