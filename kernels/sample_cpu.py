"""Greedy sampling's row argmax for the CPU (``csrc/cpu_sample*.c``), from torch.

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

# pdserve_kernels.h's argmax as a ctypes signature (cpu_build.bind).
SIGNATURES = {"pd_argmax_f32": "plilpi"}


@cache
def _kernel(isa: str | None = None):
    if isa is not None and not runs_here(isa):
        return None
    try:
        return bind(load("sample", isa), SIGNATURES)["pd_argmax_f32"]
    except KernelBuildError:
        return None


def available(isa: str | None = None) -> bool:
    """Whether this CPU runs the C argmax (in variant ``isa``, default the widest)."""
    return _kernel(isa) is not None


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
