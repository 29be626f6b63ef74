"""Shared pieces of the Triton kernels: the guarded triton import and small launch helpers.

triton is imported here, once, so that every ``kernels.triton_*`` module imports on
CPU-only installs: ``TRITON_AVAILABLE`` is then False and each kernel's entry point
raises through ``_require_triton``. To run the kernels under Triton's interpreter,
TRITON_INTERPRET=1 must be set before this module is first imported.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine uses pdserve.kernels.attention_ref.
    triton = None
    tl = None

TRITON_AVAILABLE: bool = triton is not None

_LOG2E = 1.4426950408889634


def _jit(fn):
    return triton.jit(fn) if TRITON_AVAILABLE else fn


def _require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError(
            "triton is not installed: install pdserve[triton] on a CUDA machine, "
            "or use pdserve.kernels.attention_ref"
        )


def _pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _dot_precision(dtype: torch.dtype) -> str | None:
    # fp32 in full precision, not TF32: the fp32 path is the exactness path.
    return "ieee" if dtype == torch.float32 else None


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _dot_dtype(cache_dtype: torch.dtype):
    """The dtype of tl.dot's operands: the cache's, except bf16 under the interpreter.

    Triton's interpreter multiplies bf16 operands as their raw uint16 bits; there the
    operands are rounded to bf16 first and multiplied in fp32, as the GPU's bf16 MMA
    does with its fp32 accumulator.
    """
    dtypes = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    if cache_dtype not in dtypes:
        raise ValueError(f"KV cache dtype {cache_dtype} is not supported; use fp32, fp16 or bf16")
    if cache_dtype == torch.bfloat16 and _interpreting():
        return tl.float32
    return dtypes[cache_dtype]
