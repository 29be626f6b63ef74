"""Triton kernel that writes new tokens' K and V into the paged cache.

One program per token scatters its [num_kv_heads, head_dim] rows to the token's slot,
casting to the cache's dtype; a negative slot marks a padding token and is skipped.
"""

from __future__ import annotations

import torch

from pdserve.kernels.triton_common import _jit, _pow2, _require_triton, tl


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
