"""Triton paged-attention kernels, with the signatures of ``pdserve.kernels.attention_ref``.

KV cache layout (per layer, as views into the engine's block-contiguous buffer):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
The views are strided across blocks, so every kernel addresses the cache through
its four strides; a token's slot is ``block_id * block_size + offset_in_block``.

Each kernel gathers K/V token by token through the block table (tile of TILE_N
tokens -> TILE_N block-table entries), so a tile may span several pages and any
block size works. Softmax is online, in base 2, with fp32 accumulation; ``tl.dot``
operands share the cache's dtype, and fp32 dots are asked for in IEEE precision
(not TF32) so that the fp32 path stays exact enough for greedy-equality tests.

The kernels live one idea per module: ``triton_write_kv`` (cache writes),
``triton_decode`` (split-K decode), ``triton_prefill`` (chunked prefill), and
``triton_common`` (the guarded triton import and launch helpers). This module is the
backend that ``pdserve.engine.attention`` loads by name; it re-exports their public
functions.

This module imports where triton is missing (``TRITON_AVAILABLE`` is then False
and the functions raise); it never needs a device sync when the optional
``max_*`` bounds are given or left to their shape-derived defaults.
"""

from pdserve.kernels.triton_common import TRITON_AVAILABLE
from pdserve.kernels.triton_decode import (
    DECODE_MAX_SPLITS,
    DECODE_SPLIT_TOKENS,
    decode_split_plan,
    paged_decode_attention,
)
from pdserve.kernels.triton_prefill import paged_prefill_attention
from pdserve.kernels.triton_write_kv import write_kv

__all__ = [
    "DECODE_MAX_SPLITS",
    "DECODE_SPLIT_TOKENS",
    "TRITON_AVAILABLE",
    "decode_split_plan",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv",
]
