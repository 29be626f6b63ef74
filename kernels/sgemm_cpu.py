"""float32 linears on AVX2 CPUs without AVX-512 (``csrc/cpu_sgemm.c``), from torch.

``pack(weight)`` reorders an ``[N, K]`` float32 weight once into the kernel's panels;
``linear(x, packed, bias, N)`` computes ``x @ weight.T + bias`` for ``x: [M, K]`` at any
M. By default only where this CPU has AVX2 and FMA but no AVX-512 (``available()``), where
it is faster than oneDNN at every row count measured, and for weights with
``N % 16 == 0`` (``supports``); the caller keeps oneDNN for the rest. ``isa="avx2"`` runs
the kernel on any CPU that has AVX2 (the tests do).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import torch

from pdserve.kernels import packed_gemm
from pdserve.kernels.cpu_build import KernelBuildError, bind, load, runs_here

# pdserve_kernels.h's sgemm functions as ctypes signatures (cpu_build.bind).
SIGNATURES = {"pd_sgemm_pack": "ppii", "pd_sgemm_linear": "ppppiiii"}


@cache
def _default_isa() -> str | None:
    """avx2 on CPUs with AVX2 and no AVX-512 (with AVX-512, oneDNN's path is wider), unless
    ``PDSERVE_CPU_SGEMM=0``."""
    if os.environ.get("PDSERVE_CPU_SGEMM", "").lower() in ("0", "off", "false"):
        return None
    return "avx2" if runs_here("avx2") and not runs_here("avx512") else None


@cache
def _variant(isa: str) -> dict[str, Any] | None:
    if not runs_here(isa):
        return None
    try:
        return bind(load("sgemm", isa), SIGNATURES)
    except KernelBuildError:
        return None


def _kernels(isa: str | None) -> dict[str, Any] | None:
    isa = isa or _default_isa()
    return None if isa is None else _variant(isa)


def available(isa: str | None = None) -> bool:
    """Whether float32 linears take this kernel here (``PDSERVE_CPU_SGEMM=0``: never, for
    comparisons with oneDNN); with ``isa``, whether that variant builds and runs here."""
    return _kernels(isa) is not None


def supports(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.float32 and n % 16 == 0 and 0 < n < 2**31 and 0 < k < 2**31


def pack(weight: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """[N, K] float32 -> the same values as [N/16, K, 16] panels (flat)."""
    kern = _kernels(isa)
    if kern is None or not supports(weight):
        raise ValueError(f"no sgemm packing for a {tuple(weight.shape)} {weight.dtype} weight")
    return packed_gemm.pack(kern["pd_sgemm_pack"], weight, torch.float32)


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    isa: str | None = None,
) -> torch.Tensor:
    """[M, K] float32 -> [M, out_features] float32 through a packed weight."""
    fn = _kernels(isa)["pd_sgemm_linear"]
    return packed_gemm.linear(fn, x, packed, bias, out_features, torch.float32)
