"""float32 linears on AVX2 CPUs without AVX-512 (``csrc/cpu_sgemm.c``), from torch.

``pack(weight)`` reorders an ``[N, K]`` float32 weight once into the kernel's panels;
``linear(x, packed, bias, N)`` computes ``x @ weight.T + bias`` for ``x: [M, K]`` at any
M. Only where the kernel is built for this CPU (``available()``: AVX2 and FMA, no
AVX-512, where it is faster than oneDNN at every row count measured) and for weights
with ``N % 16 == 0`` (``supports``); the caller keeps oneDNN for the rest.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

import torch

from pdserve.kernels import packed_gemm
from pdserve.kernels.cpu_build import KernelBuildError, bind, load


@cache
def _kernels() -> dict[str, object] | None:
    if os.environ.get("PDSERVE_CPU_SGEMM", "").lower() in ("0", "off", "false"):
        return None
    try:
        lib = load("cpu_sgemm")
    except KernelBuildError:
        return None
    if not bind(lib, "pd_sgemm_available", "", restype=ctypes.c_int)():
        return None
    return {
        "pack": bind(lib, "pd_sgemm_pack", "ppii"),
        "linear": bind(lib, "pd_sgemm_linear", "ppppiiii"),
    }


def available() -> bool:
    """Whether float32 linears take this kernel here (``PDSERVE_CPU_SGEMM=0``: never,
    for comparisons with oneDNN)."""
    return _kernels() is not None


def supports(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.float32 and n % 16 == 0 and 0 < n < 2**31 and 0 < k < 2**31


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> the same values as [N/16, K, 16] panels (flat)."""
    kern = _kernels()
    if kern is None or not supports(weight):
        raise ValueError(f"no sgemm packing for a {tuple(weight.shape)} {weight.dtype} weight")
    return packed_gemm.pack(kern["pack"], weight, torch.float32)


def linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """[M, K] float32 -> [M, out_features] float32 through a packed weight."""
    return packed_gemm.linear(_kernels()["linear"], x, packed, bias, out_features, torch.float32)
