"""MKL-packed float32 linears for CPU decode, applied to a finished model from outside.

MKL's packed sgemm is 1.4-1.8x faster than ``F.linear`` at decode-sized batches (2 to
64 rows), but only for the row count it was packed for. So each layer keeps one packed
copy per bucket of row counts (8, 16, 32, 64, up to ``--max-num-seqs``); a batch is
padded up to its bucket, and a single row (a GEMV, as fast either way) or a prefill
chunk larger than every bucket goes to ``F.linear``. Each bucket costs one more copy of
the linear weights in memory (about 0.5 GB for SmolLM2-135M).
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F
from torch import nn

BUCKETS = (8, 16, 32, 64)


def buckets_for(max_num_seqs: int) -> tuple[int, ...]:
    """Row counts to pack for: the standard buckets below ``max_num_seqs``, and it."""
    return tuple(sorted({b for b in BUCKETS if b < max_num_seqs} | {max_num_seqs}))


def mkl_packing_available() -> bool:
    return (
        hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight") and torch.backends.mkl.is_available()
    )


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is also kept MKL-packed for each bucket's row count."""

    def __init__(self, linear: nn.Linear, buckets: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.buckets = tuple(sorted(buckets))
        w = linear.weight.detach()
        self.packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for rows in self.buckets]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        i = bisect.bisect_left(self.buckets, m)
        if m < 2 or i == len(self.buckets):
            return F.linear(x, self.weight, self.bias)
        rows = self.buckets[i]
        if m < rows:
            padded = x.new_zeros(rows, x.shape[1])
            padded[:m] = x
            out = torch.ops.mkl._mkl_linear(padded, self.packed[i], self.weight, self.bias, rows)
            return out[:m]
        return torch.ops.mkl._mkl_linear(x, self.packed[i], self.weight, self.bias, rows)


def pack_linears(model: nn.Module, buckets: tuple[int, ...]) -> int:
    """Replace every float32 CPU ``nn.Linear`` in ``model`` by a PackedLinear; returns how many."""
    count = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if (
                isinstance(child, nn.Linear)
                and child.weight.dtype == torch.float32
                and child.weight.device.type == "cpu"
            ):
                setattr(module, child_name, PackedLinear(child, buckets))
                count += 1
    return count
