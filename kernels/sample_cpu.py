"""Greedy sampling's row argmax, and structured outputs' token mask, for the CPU
(``csrc/cpu_sample*.c``), from torch.

``argmax(x)`` answers ``x.argmax(dim=-1)`` for ``x: [M, vocab]`` fp32 on the CPU, with
the same tie and NaN rules (the first index of the largest value; a row with a NaN gives
its first NaN), at memory speed, in the widest variant this CPU runs (avx512 or avx2;
``isa=`` runs another, as the tests do). Other dtypes, devices and CPUs without AVX-512 or
AVX2 take torch's.
"""

from __future__ import annotations

from functools import cache

import torch

from pdserve.kernels.cpu_build import KernelBuildError, bind, load, runs_here

# pdserve_kernels.h's sampling functions as ctypes signatures (cpu_build.bind).
SIGNATURES = {"pd_argmax_f32": "plilpi", "pd_apply_bitmask_f32": "plplpili"}


@cache
def _kernels(isa: str | None = None) -> dict | None:
    if isa is not None and not runs_here(isa):
        return None
    try:
        return bind(load("sample", isa), SIGNATURES)
    except KernelBuildError:
        return None


def _kernel(isa: str | None = None, name: str = "pd_argmax_f32"):
    kernels = _kernels(isa)
    return None if kernels is None else kernels[name]


def available(isa: str | None = None) -> bool:
    """Whether this CPU runs the C kernels (in variant ``isa``, default the widest)."""
    return _kernels(isa) is not None


def apply_bitmask(
    x: torch.Tensor, mask: torch.Tensor, rows: list[int], isa: str | None = None
) -> bool:
    """Set ``x[r, i]`` to -inf, in place, where bit i of ``mask[r]`` is 0, for r in ``rows``
    (xgrammar's bitmask: [M, ceil(vocab / 32)] int32, row r for x's row r); False, changing
    nothing, where the C kernel does not take it (the caller then applies it another way)."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.stride(1) != 1
        or mask.dtype != torch.int32
        or mask.stride(1) != 1
        or mask.shape[0] != x.shape[0]
        or (kern := _kernel(isa, "pd_apply_bitmask_f32")) is None
    ):
        return False
    n = min(x.shape[1], mask.shape[1] * 32)
    index = torch.tensor(rows, dtype=torch.int64)
    kern(
        x.data_ptr(),
        x.stride(0),
        mask.data_ptr(),
        mask.stride(0),
        index.data_ptr(),
        len(rows),
        n,
        torch.get_num_threads(),
    )
    return True


def argmax(x: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """[M, N] -> [M] int64, as ``x.argmax(dim=-1)``."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 2
        or not 0 < x.shape[1] < 2**31
        or x.stride(1) != 1
        or (kern := _kernel(isa)) is None
    ):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kern(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out
