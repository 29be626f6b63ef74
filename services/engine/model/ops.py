"""The custom ops a model calls for what runs outside torch's own kernels: paged attention
and the CPU's packed linears. ``torch.compile`` treats them as opaque calls (it fuses the
code between them), and a CUDA graph captures the kernels they launch. Their state comes
from the forward context that the model runner sets around each step.

They are defined with ``torch.library.Library`` rather than ``torch.library.custom_op``:
the dispatcher then calls the Python kernel directly, without custom_op's per-call wrapper
and aliasing check (about 2 us of 4-5 a call; a compiled decode step makes about 150
calls: ``bench/engine/op_dispatch.py``).

On the CPU, where the C++ operators of ``kernels/csrc/torch_ops.cpp`` build
(``cpu_ops_error() is None``), the model calls those instead (``pdserve_cpu::linear`` and
``pdserve_cpu::attention``): a compiled step then runs its linears and decode attention
without entering Python, and with inductor's C++ wrapper without taking the GIL. Their
attention reads the step from a per-thread context that ``cpu_step`` sets; the prefill
rows of a step call back into ``pdserve::prefill_attention`` here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from functools import cache

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.forward_context import get_forward_context

logger = logging.getLogger(__name__)

_lib = torch.library.Library("pdserve", "DEF")
_lib.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scale, "
    "int window) -> Tensor"
)
_lib.define("cpu_linear(Tensor x, Tensor handle, int out_features) -> Tensor")
_lib.define("prefill_attention(Tensor query, int layer, float scale, int window) -> Tensor")


def _paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    window: int,
) -> torch.Tensor:
    ctx = get_forward_context()
    key_cache, value_cache = ctx.kv_caches[layer]
    return ctx.attention(query, key, value, key_cache, value_cache, ctx.meta, scale, window)


def _prefill_attention(query: torch.Tensor, layer: int, scale: float, window: int) -> torch.Tensor:
    """The step's prefill rows (their K/V already written) against the paged cache."""
    ctx = get_forward_context()
    key_cache, value_cache = ctx.kv_caches[layer]
    return ctx.attention.prefill(query, key_cache, value_cache, ctx.meta, scale, window)


def _cpu_linear(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return get_forward_context().linears[int(handle)].run(x)


# One kernel for every device; the ops run under inference mode only (no autograd formula).
_lib.impl("paged_attention", _paged_attention, "CompositeExplicitAutograd")
_lib.impl("cpu_linear", _cpu_linear, "CompositeExplicitAutograd")
_lib.impl("prefill_attention", _prefill_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::paged_attention")
def _(query, key, value, layer, scale, window):
    return torch.empty_like(query)


@torch.library.register_fake("pdserve::cpu_linear")
def _(x, handle, out_features):
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("pdserve::prefill_attention")
def _(query, layer, scale, window):
    return torch.empty_like(query)


@cache
def cpu_ops_error() -> str | None:
    """None when the C++ operators (``pdserve_cpu::*``) are built and loaded here, else why
    not. ``PDSERVE_CPU_OPS=python`` keeps the Python ops (for comparisons)."""
    if os.environ.get("PDSERVE_CPU_OPS", "").lower() == "python":
        return "PDSERVE_CPU_OPS=python"
    from pdserve.kernels.cpu_build import KernelBuildError, load_torch_ops

    try:
        load_torch_ops("torch_ops", ("attention", "gemm", "sgemm"))
    except KernelBuildError as e:
        logger.warning("the C++ CPU operators do not build here, using Python ops: %s", e)
        return str(e)
    _register_cpp_fakes()
    return None


@cache
def _register_cpp_fakes() -> None:
    """Shapes of the C++ ops' outputs, for tracing."""

    @torch.library.register_fake("pdserve_cpu::attention")
    def _(query, key, value, layer, scale, window):
        return torch.empty_like(query)

    @torch.library.register_fake("pdserve_cpu::linear")
    def _(x, onednn_weight, kernel_weight, bias, out_features, kernel_max_rows):
        return x.new_empty(x.shape[0], out_features)


_NO_TABLES = torch.empty(0, 0, dtype=torch.int32)
_NO_LENS = torch.empty(0, dtype=torch.int32)


@contextlib.contextmanager
def cpu_step(kv: torch.Tensor, meta: AttentionMetadata) -> Iterator[None]:
    """The step that ``pdserve_cpu::attention`` calls inside the block read."""
    nd = meta.num_decode_tokens
    tables = meta.decode_block_tables if nd else _NO_TABLES
    lens = meta.decode_seq_lens if nd else _NO_LENS
    torch.ops.pdserve_cpu.set_step(kv, meta.slot_mapping, tables, lens, nd)
    try:
        yield
    finally:
        torch.ops.pdserve_cpu.clear_step()


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Write layer ``layer``'s new K/V into the paged cache, then attend over it (with
    ``window`` > 0, each query over its last ``window`` positions only).

    query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads, head_dim].
    """
    return torch.ops.pdserve.paged_attention(query, key, value, layer, scale, window)


def cpu_linear(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    """The context's ``linears[handle]`` applied to x: [rows, in] -> [rows, out_features].

    handle: a one-element CPU tensor holding the linear's index.
    """
    return torch.ops.pdserve.cpu_linear(x, handle, out_features)
