"""The custom ops a model calls for what runs outside torch's own kernels: paged attention
and the CPU's packed linears. ``torch.compile`` treats them as opaque calls (it fuses the
code between them), and a CUDA graph captures the kernels they launch. Their state comes
from the forward context that the model runner sets around each step.

They are defined with ``torch.library.Library`` rather than ``torch.library.custom_op``:
the dispatcher then calls the Python kernel directly, without custom_op's per-call wrapper
and aliasing check (about 2 us of 4-5 a call; a compiled decode step makes about 150
calls: ``bench/op_dispatch.py``).
"""

from __future__ import annotations

import torch

from services.engine.forward_context import get_forward_context

_lib = torch.library.Library("pdserve", "DEF")
_lib.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scale) -> Tensor"
)
_lib.define("cpu_linear(Tensor x, Tensor handle, int out_features) -> Tensor")


def _paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    ctx = get_forward_context()
    key_cache, value_cache = ctx.kv_caches[layer]
    return ctx.attention(query, key, value, key_cache, value_cache, ctx.meta, scale)


def _cpu_linear(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return get_forward_context().linears[int(handle)].run(x)


# One kernel for every device; the ops run under inference mode only (no autograd formula).
_lib.impl("paged_attention", _paged_attention, "CompositeExplicitAutograd")
_lib.impl("cpu_linear", _cpu_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::paged_attention")
def _(query, key, value, layer, scale):
    return torch.empty_like(query)


@torch.library.register_fake("pdserve::cpu_linear")
def _(x, handle, out_features):
    return x.new_empty(x.shape[0], out_features)


def paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    """Write layer ``layer``'s new K/V into the paged cache, then attend over it.

    query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads, head_dim].
    """
    return torch.ops.pdserve.paged_attention(query, key, value, layer, scale)


def cpu_linear(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    """The context's ``linears[handle]`` applied to x: [rows, in] -> [rows, out_features].

    handle: a one-element CPU tensor holding the linear's index.
    """
    return torch.ops.pdserve.cpu_linear(x, handle, out_features)
