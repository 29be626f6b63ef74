"""Triton paged-attention kernels, with the signatures of ``kernels.attention_ref``.

KV cache layout (per layer, as views into the engine's block-contiguous buffer):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
The views are strided across blocks, so every kernel addresses the cache through
its four strides; a token's slot is ``block_id * block_size + offset_in_block``.

Each kernel gathers K/V token by token through the block table (tile of TILE_N
tokens -> TILE_N block-table entries), so a tile may span several pages and any
block size works. Softmax is online, in base 2, with fp32 accumulation; ``tl.dot``
operands share the cache's dtype, and fp32 dots are asked for in IEEE precision
(not TF32) so that the fp32 path stays exact enough for greedy-equality tests.

This module imports where triton is missing (``TRITON_AVAILABLE`` is then False
and the functions raise); it never needs a device sync when the optional
``max_*`` bounds are given or left to their shape-derived defaults.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine uses kernels.attention_ref.
    triton = None
    tl = None

TRITON_AVAILABLE: bool = triton is not None

# Decode split-K: a split covers a fixed number of context tokens, so a sequence's
# result depends on its own length only, not on the batch it is in (up to
# DECODE_MAX_SPLITS * DECODE_SPLIT_TOKENS tokens, past which splits grow).
DECODE_SPLIT_TOKENS = 256
DECODE_MAX_SPLITS = 64

_LOG2E = 1.4426950408889634


def _jit(fn):
    return triton.jit(fn) if TRITON_AVAILABLE else fn


def _require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError(
            "triton is not installed: install pdserve[triton] on a CUDA machine, "
            "or use kernels.attention_ref"
        )


def _pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _dot_precision(dtype: torch.dtype) -> str | None:
    # fp32 in full precision, not TF32: the fp32 path is the exactness path.
    return "ieee" if dtype == torch.float32 else None


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _dot_dtype(cache_dtype: torch.dtype):
    """The dtype of tl.dot's operands: the cache's, except bf16 under the interpreter.

    Triton's interpreter multiplies bf16 operands as their raw uint16 bits; there the
    operands are rounded to bf16 first and multiplied in fp32, as the GPU's bf16 MMA
    does with its fp32 accumulator.
    """
    dtypes = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    if cache_dtype not in dtypes:
        raise ValueError(f"KV cache dtype {cache_dtype} is not supported; use fp32, fp16 or bf16")
    if cache_dtype == torch.bfloat16 and _interpreting():
        return tl.float32
    return dtypes[cache_dtype]


# --------------------------------------------------------------------------- write_kv


@_jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token: its [num_kv_heads, head_dim] K and V rows.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token (e.g. CUDA-graph padding): nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)

    k = tl.load(
        key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask
    )
    v = tl.load(
        value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask
    )
    kc = key_cache_ptr + block * stride_kcb + offset * stride_kct
    vc = value_cache_ptr + block * stride_vcb + offset * stride_vct
    tl.store(
        kc + h[:, None] * stride_kch + d[None, :] * stride_kcd,
        k.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        vc + h[:, None] * stride_vch + d[None, :] * stride_vcd,
        v.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K and V into their cache slots (cast to the cache's dtype).

    key, value: [num_tokens, num_kv_heads, head_dim], any strides
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], any strides
    slot_mapping: [num_tokens] int32/int64; a negative slot is skipped (padding token).
    """
    _require_triton()
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kc, vc = key_cache, value_cache
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kc,
        vc,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *kc.stride(),
        *vc.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=_pow2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_pow2(head_dim),
        BLOCK_SIZE=kc.shape[1],
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


# --------------------------------------------------------------------------- decode


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
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    # Program (seq, kv_head, split): all GROUP_SIZE query heads of one KV head against
    # context tokens [split * tokens_per_split, +tokens_per_split) of one sequence.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * tokens_per_split
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
    splits, tokens_per_split = decode_split_plan(max_seq_len, head_dim, num_splits)

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


# --------------------------------------------------------------------------- prefill


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
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_head = key_cache_ptr + kv_head * stride_kh + d[None, :] * stride_kd
    v_head = value_cache_ptr + kv_head * stride_vh + d[None, :] * stride_vd
    for tile_start in range(0, kv_end, BLOCK_N):
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
        qk = tl.where(visible, qk, float("-inf"))  # [BLOCK_M, BLOCK_N]
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
) -> torch.Tensor:
    """A chunk of query tokens per sequence, packed, against the paged context, causally.

    Sequence i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; they are its
    last tokens, at positions ``seq_lens[i] - q_len_i .. seq_lens[i] - 1``. Their K/V are
    already in the cache. Token at position p attends to context positions 0..p.

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
        DOT_PRECISION=_dot_precision(key_cache.dtype),
        DOT_DTYPE=_dot_dtype(key_cache.dtype),
        num_warps=4 if head_dim_pad <= 128 else 8,
        num_stages=2,
    )
    return out
