"""bf16 linears on Intel AMX for decode-sized batches (``csrc/cpu_gemm.c``), from torch.

``pack(weight)`` reorders an ``[N, K]`` bf16 weight once into the kernel's tile layout;
``linear(x, packed, bias, N)`` computes ``x @ weight.T + bias`` for ``x: [M, K]``. Only
for CPUs with AMX (``available()``) and shapes with ``K % 32 == 0 and N % 32 == 0``
(``supports``); the caller keeps another path for the rest.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from pdserve.kernels import packed_gemm
from pdserve.kernels.cpu_build import KernelBuildError, bind, load, runs_here

# pdserve_kernels.h's AMX GEMM functions as ctypes signatures (cpu_build.bind).
SIGNATURES = {"pd_amx_init": "->i", "pd_amx_pack": "ppii", "pd_amx_linear": "ppppiiii"}


@cache
def _kernels() -> dict[str, Any] | None:
    if not runs_here("amx"):
        return None
    try:
        kern = bind(load("gemm", "amx"), SIGNATURES)
    except KernelBuildError:
        return None
    return kern if kern["pd_amx_init"]() else None


def available() -> bool:
    """Whether this CPU runs the AMX kernel (and this process may use AMX tiles)."""
    return _kernels() is not None


def supports(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and k % 32 == 0 and n % 32 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> the same values as [N/16, K/32, 16, 16, 2] B tiles (flat)."""
    kern = _kernels()
    if kern is None or not supports(weight):
        raise ValueError(f"no AMX packing for a {tuple(weight.shape)} {weight.dtype} weight")
    return packed_gemm.pack(kern["pd_amx_pack"], weight, torch.bfloat16)


def linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """[M, K] bf16 -> [M, out_features] bf16 through an AMX-packed weight."""
    fn = _kernels()["pd_amx_linear"]
    return packed_gemm.linear(fn, x, packed, bias, out_features, torch.bfloat16)
