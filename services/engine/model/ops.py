"""The custom ops a model calls for what runs outside torch's own kernels: paged attention
and the CPU's packed linears. ``torch.compile`` treats them as opaque calls (it fuses the
code between them), and a CUDA graph captures the kernels they launch. Their state comes
from the forward context that the model runner sets around each step.
"""

from __future__ import annotations

import torch

from services.engine.forward_context import get_forward_context


@torch.library.custom_op("pdserve::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    """Write layer ``layer``'s new K/V into the paged cache, then attend over it.

    query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads, head_dim].
    """
    ctx = get_forward_context()
    key_cache, value_cache = ctx.kv_caches[layer]
    return ctx.attention(query, key, value, key_cache, value_cache, ctx.meta, scale)


@paged_attention.register_fake
def _(query, key, value, layer, scale):
    return torch.empty_like(query)


@torch.library.custom_op("pdserve::cpu_linear", mutates_args=())
def cpu_linear(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    """The context's ``linears[handle]`` applied to x: [rows, in] -> [rows, out_features].

    handle: a one-element CPU tensor holding the linear's index.
    """
    return get_forward_context().linears[int(handle)].run(x)


@cpu_linear.register_fake
def _(x, handle, out_features):
    return x.new_empty(x.shape[0], out_features)
