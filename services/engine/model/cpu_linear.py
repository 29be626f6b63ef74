"""Packed linears for the CPU, applied to a finished model from outside.

Each ``nn.Linear`` becomes a ``PackedLinear`` that holds its weight in the layouts the
fast kernels read, packed once at start:

- float32 on CPUs with AVX2 and FMA but no AVX-512: only the sgemm kernel's panels
  (``pdserve.kernels.sgemm_cpu``), for every row count: 1.15-1.7x oneDNN's speed there from 1 to
  512 rows (``bench/kernels/sgemm_cpu.py``), and one copy of the weights rather than two;
- otherwise oneDNN's blocked layout for this CPU (AMX tiles, AVX-512 or AVX2), for every
  row count;
- for bfloat16 on CPUs with AMX, also the AMX kernel's tile layout (``pdserve.kernels.gemm_cpu``),
  used up to ``AMX_MAX_ROWS`` rows: at decode sizes a linear is bound by reading its
  weights and oneDNN's small-batch path reads them well below the memory bandwidth; at
  prefill chunk sizes the kernel splits the columns evenly over the threads, where
  oneDNN's split leaves one thread waiting for the other.

The plain weight is dropped. The model calls its linears through an opaque op, so that a
compiled model does not look inside: the C++ ``pdserve_cpu::linear`` where it builds (it
takes the packed weights as inputs), else the Python ``pdserve::cpu_linear``.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from pdserve.engine.model import ops
from pdserve.kernels import gemm_cpu, sgemm_cpu

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Up to this many rows a bf16 linear takes the AMX kernel. Measured on SmolLM2's layers
# (2 threads): 1.3-1.9x oneDNN's speed at 1-32 rows, about equal from 128 to 1024 rows
# (and faster within a step, see above), slower from 2048 rows on.
AMX_MAX_ROWS = 1024
ALL_ROWS = 2**62  # the kernel weight is the only one: every row count takes it


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN packs ``dtype`` linears on this CPU: bf16 needs AVX-512 (BW, VL, DQ),
    AVX-NE-CONVERT or AMX; without them torch computes bf16 linears unpacked."""
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and dtype in PACKED_DTYPES
    ):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight held only in packed layouts; ``index`` is its place in
    the model's list of packed linears (the forward context's ``linears``)."""

    def __init__(
        self, linear: nn.Linear, index: int, use_amx: bool, cpp_op: bool, use_sgemm: bool = False
    ) -> None:
        super().__init__()
        self.index = index
        self.cpp_op = cpp_op
        # The index as a tensor input of the op, so that every layer's region is the same code.
        self.handle = torch.tensor([index])
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.onednn: torch.Tensor | None = None
        self.kernel: torch.Tensor | None = None  # sgemm panels (float32) or AMX tiles (bf16)
        self.kernel_name = ""
        self.kernel_max_rows = 0
        if use_sgemm and sgemm_cpu.supports(weight):
            self.kernel, self.kernel_name = sgemm_cpu.pack(weight), "sgemm"
            self.kernel_max_rows = ALL_ROWS
        else:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            if use_amx and gemm_cpu.supports(weight):
                self.kernel, self.kernel_name = gemm_cpu.pack(weight), "amx"
                self.kernel_max_rows = AMX_MAX_ROWS
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpp_op:
            return torch.ops.pdserve_cpu.linear(
                x, self.onednn, self.kernel, self.bias, self.out_features, self.kernel_max_rows
            )
        return ops.cpu_linear(x, self.handle, self.out_features)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in_features] in the weight's dtype -> [rows, out_features]."""
        if self.kernel is not None and x.shape[0] <= self.kernel_max_rows:
            module = sgemm_cpu if self.kernel_name == "sgemm" else gemm_cpu
            return module.linear(x, self.kernel, self.bias, self.out_features)
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")

    def kinds(self) -> str:
        """The layouts held: "onednn", "sgemm", "onednn + amx"."""
        held = ["onednn"] if self.onednn is not None else []
        return " + ".join(held + ([self.kernel_name] if self.kernel_name else []))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kinds()}"


def describe(packed: list[PackedLinear]) -> str:
    """How many packed linears hold which layouts, e.g. "121 sgemm" (for the start log)."""
    counts = Counter(linear.kinds() for linear in packed)
    return ", ".join(f"{n} {kinds}" for kinds, n in counts.items()) or "none"


def pack_linears(model: nn.Module, cpp_op: bool) -> list[PackedLinear]:
    """Replace every CPU ``nn.Linear`` of a packable dtype in ``model``; the new modules, in
    the order of their ``index``. ``cpp_op``: they call ``pdserve_cpu::linear``."""
    use_amx = gemm_cpu.available()
    use_sgemm = sgemm_cpu.available()
    packed: list[PackedLinear] = []
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (
                isinstance(child, nn.Linear)
                and child.weight.device.type == "cpu"
                and packing_available(child.weight.dtype)
            ):
                linear = PackedLinear(child, len(packed), use_amx, cpp_op, use_sgemm)
                setattr(module, name, linear)
                packed.append(linear)
    return packed
