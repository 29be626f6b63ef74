"""The CPU attention backend: C kernels (``csrc/cpu_attention.c``) with the signatures of
``pdserve.kernels.attention_ref``.

Decode attention reads each sequence's K/V from the paged cache in place (no gather) and
the KV write skips negative slots (padding rows of a bucketed batch); prefill keeps the
reference's gather + SDPA, with the step's index tensors and mask (``PrefillPlan``) made
once for all layers rather than once per layer. The C code runs without the GIL (ctypes
releases it) on torch's OpenMP threads.
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache

import torch

from pdserve.kernels import attention_ref
from pdserve.kernels.cpu_build import KernelBuildError, bind, load

__all__ = [
    "available",
    "build_error",
    "paged_decode_attention",
    "paged_prefill_attention",
    "vector_path",
    "write_kv",
]

_plans = threading.local()  # the last step's PrefillPlan, per engine thread


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
    """``attention_ref.paged_prefill_attention``; a step's layers pass the same metadata
    tensors, so the plan made at the first layer serves the others."""
    step = (block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len)
    plan = getattr(_plans, "last", None)
    if plan is None or not plan.matches(query.shape[0], *step):
        plan = attention_ref.PrefillPlan(query.shape[0], key_cache, *step)
        _plans.last = plan
    return plan.attend(query, key_cache, value_cache, scale)


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@cache
def _kernels() -> dict[str, object]:
    lib = load("cpu_attention")
    fns = {}
    for sfx in _SUFFIX.values():
        fns[f"write_kv_{sfx}"] = bind(lib, f"pd_write_kv_{sfx}", "ppllllpplllpiiii")
        fns[f"decode_{sfx}"] = bind(lib, f"pd_decode_attention_{sfx}", "pllpplllplpiiiiifpi")
    fns["vector_path"] = bind(lib, "pd_vector_path", "", ctypes.c_int)
    return fns


def vector_path() -> str:
    """The decode kernel's vector path on this machine: avx512, avx2 or portable."""
    return ("portable", "avx2", "avx512")[_kernels()["vector_path"]()]


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
) -> None:
    """As ``attention_ref.write_kv``; a negative slot (a padding row) is skipped."""
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
    fn = _kernels()[f"write_kv_{_suffix(key_cache)}"]
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
) -> torch.Tensor:
    """As ``attention_ref.paged_decode_attention``; a sequence of length 0 gets zeros."""
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
    fn = _kernels()[f"decode_{_suffix(key_cache)}"]
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
        float(scale),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out.to(query.dtype)
