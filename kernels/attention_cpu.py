"""The CPU attention backend: C kernels (``csrc/cpu_attention*.c``) with the signatures of
``pdserve.kernels.attention_ref``.

Decode attention reads each sequence's K/V from the paged cache in place (no gather) and
the KV write skips negative slots (padding rows of a bucketed batch); prefill keeps the
reference's gather + SDPA, with the step's index tensors and mask (``PrefillPlan``) made
once for all layers rather than once per layer (a plan per window, for models whose layers
mix window sizes). A sliding window (``window`` > 0) starts each sequence's decode loop at
its first token in the window, so no block before it is read. The C code runs without the
GIL (ctypes releases it) on torch's OpenMP threads, in the widest variant this CPU runs
(avx512, avx2 or portable: ``vector_path()``); ``isa=`` runs another (the tests run each).
"""

from __future__ import annotations

import threading
from functools import cache
from typing import Any

import torch

from pdserve.kernels import attention_ref
from pdserve.kernels.cpu_build import KernelBuildError, bind, choose, load

__all__ = [
    "available",
    "build_error",
    "paged_decode_attention",
    "paged_prefill_attention",
    "vector_path",
    "write_kv",
]

_plans = threading.local()  # the last step's PrefillPlan of each window, per engine thread


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
    """``attention_ref.paged_prefill_attention``; a step's layers pass the same metadata
    tensors, so the plan made at the first layer of a window serves the others."""
    step = (query.shape[0], block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len)
    plans = getattr(_plans, "by_window", {})
    plan = plans.get(window)
    if plan is None or not plan.matches(*step, window):
        plan = attention_ref.PrefillPlan(step[0], key_cache, *step[1:], window)
        # Plans of an earlier step go; this step's other windows stay.
        plans = {w: p for w, p in plans.items() if p.matches(*step, w)}
        plans[window] = plan
        _plans.by_window = plans
    return plan.attend(query, key_cache, value_cache, scale)


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}

# pdserve_kernels.h's attention functions as ctypes signatures (cpu_build.bind).
SIGNATURES = {
    "pd_write_kv_f32": "ppllllpplllpiiii",
    "pd_write_kv_bf16": "ppllllpplllpiiii",
    "pd_decode_attention_f32": "pllpplllplpiiiiiifpi",
    "pd_decode_attention_bf16": "pllpplllplpiiiiiifpi",
}


@cache
def _kernels(isa: str | None = None) -> dict[str, Any]:
    return bind(load("attention", isa), SIGNATURES)


def vector_path() -> str:
    """The variant the kernels run in on this machine: avx512, avx2 or portable."""
    return choose("attention") or "portable"


@cache
def build_error() -> str | None:
    """None when the kernels build and load here, else why they do not."""
    try:
        _kernels()
    except KernelBuildError as e:
        return str(e)
    return None


def available() -> bool:
    return build_error() is None


def _suffix(t: torch.Tensor) -> str:
    try:
        return _SUFFIX[t.dtype]
    except KeyError:
        raise TypeError(f"the CPU kernels take float32 or bfloat16, not {t.dtype}") from None


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    s_block, s_tok, s_head, s_dim = cache.stride()
    if s_dim != 1:
        raise ValueError("the CPU kernels need each cache row's head_dim to be contiguous")
    return s_block, s_tok, s_head


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    isa: str | None = None,
) -> None:
    """As ``attention_ref.write_kv``; a negative slot (a padding row) is skipped. ``isa``:
    the kernels' variant (default: the widest this CPU runs)."""
    n, hkv, d = key.shape
    if n == 0:
        return
    key = key.to(key_cache.dtype)
    value = value.to(value_cache.dtype)
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must share their strides")
    slots = slot_mapping.to(torch.int64).contiguous()
    fn = _kernels(isa)[f"pd_write_kv_{_suffix(key_cache)}"]
    fn(
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        *_cache_strides(key_cache),
        slots.data_ptr(),
        n,
        hkv,
        d,
        key_cache.shape[1],
    )


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    window: int = 0,
    isa: str | None = None,
) -> torch.Tensor:
    """As ``attention_ref.paged_decode_attention``; a sequence of length 0 gets zeros.
    ``isa``: the kernels' variant (default: the widest this CPU runs)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} KV groups")
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must share their strides")
    q = query.to(key_cache.dtype)
    if q.stride(2) != 1:
        q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=key_cache.dtype)
    if num_seqs == 0:
        return out.to(query.dtype)
    fn = _kernels(isa)[f"pd_decode_attention_{_suffix(key_cache)}"]
    fn(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        *_cache_strides(key_cache),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        key_cache.shape[1],
        window,
        float(scale),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out.to(query.dtype)
