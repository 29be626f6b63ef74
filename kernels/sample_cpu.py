"""Greedy sampling's row argmax for the CPU (``csrc/cpu_sample.c``), from torch.

``argmax(x)`` answers ``x.argmax(dim=-1)`` for ``x: [M, vocab]`` fp32 on the CPU, with
the same tie and NaN rules (the first index of the largest value; a row with a NaN gives
its first NaN), at memory speed. Other dtypes, devices and CPUs without AVX-512 or AVX2
take torch's.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from pdserve.kernels.cpu_build import KernelBuildError, bind, load


@cache
def _kernel():
    try:
        lib = load("cpu_sample")
    except KernelBuildError:
        return None
    if not bind(lib, "pd_argmax_available", "", restype=ctypes.c_int)():
        return None
    return bind(lib, "pd_argmax_f32", "plilpi")


def available() -> bool:
    """Whether this CPU runs the C argmax."""
    return _kernel() is not None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """[M, N] -> [M] int64, as ``x.argmax(dim=-1)``."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 2
        or not 0 < x.shape[1] < 2**31
        or x.stride(1) != 1
        or (kern := _kernel()) is None
    ):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kern(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out
