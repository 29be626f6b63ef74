"""The torch side shared by the CPU GEMM kernels that take a weight packed once
(``sgemm_cpu``: float32 panels; ``gemm_cpu``: AMX bf16 tiles): both export
``pack(w, out, N, K)`` and ``linear(x, packed, bias, y, M, N, K, threads)``."""

from __future__ import annotations

import torch


def pack(fn, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` [N, K] through the kernel's packing ``fn``: a flat tensor of ``dtype``."""
    w = weight.detach().contiguous()
    out = torch.empty(w.numel(), dtype=dtype)
    fn(w.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1])
    return out


def linear(
    fn,
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[M, K] ``dtype`` -> [M, out_features] ``dtype`` through the kernel's ``fn``."""
    if x.dtype != dtype or x.dim() != 2:
        raise ValueError(f"the kernel takes [M, K] {dtype} inputs, not {x.dtype} {tuple(x.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    m, k = x.shape
    if packed.numel() != k * out_features:
        raise ValueError(f"a packed {packed.numel()}-value weight is not [{out_features}, {k}]")
    y = torch.empty(m, out_features, dtype=dtype)
    b = None if bias is None else bias.to(dtype).contiguous()  # alive through the call
    fn(
        x.data_ptr(),
        packed.data_ptr(),
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        m,
        out_features,
        k,
        torch.get_num_threads(),
    )
    return y
