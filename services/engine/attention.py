"""The attention-backend interface: one paged-attention call per layer, whatever the kernels.

A backend is a module of kernels with the signatures of ``pdserve.kernels.attention_ref``:
the torch reference runs anywhere (and is the oracle of the others), the C kernels
(``cpu``) on CPUs with a C compiler, the Triton kernels on CUDA. Backends are imported
only when chosen.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_BACKENDS = {
    "torch": "pdserve.kernels.attention_ref",
    "cpu": "pdserve.kernels.attention_cpu",
    "triton": "pdserve.kernels.triton_attention",
}


@dataclass
class AttentionMetadata:
    """Flat description of one step's batch. Decode tokens (one per sequence) come first.

    slot_mapping: [num_tokens] cache slot of every new token.
    decode_*: the first ``num_decode_tokens`` rows, one per sequence.
    prefill_*: the remaining rows, packed by ``prefill_query_start_loc`` (starts at 0).
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    decode_max_seq_len: int = 0
    prefill_block_tables: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_max_query_len: int = 0
    prefill_max_seq_len: int = 0


class PagedAttention:
    """Writes a layer's new K/V into the paged cache, then attends over it."""

    def __init__(self, kernels: ModuleType, name: str) -> None:
        self.kernels = kernels
        self.name = name

    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,  # > 0: a query at position p sees keys p - window < j <= p
    ) -> torch.Tensor:
        kern = self.kernels
        kern.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        parts = []
        if nd:
            parts.append(
                kern.paged_decode_attention(
                    q[:nd],
                    key_cache,
                    value_cache,
                    meta.decode_block_tables,
                    meta.decode_seq_lens,
                    scale,
                    max_seq_len=meta.decode_max_seq_len or None,
                    window=window,
                )
            )
        if nd < q.shape[0]:
            parts.append(self.prefill(q[nd:], key_cache, value_cache, meta, scale, window))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def prefill(
        self,
        q: torch.Tensor,  # the step's prefill rows, their K/V already in the cache
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        return self.kernels.paged_prefill_attention(
            q,
            key_cache,
            value_cache,
            meta.prefill_block_tables,
            meta.prefill_seq_lens,
            meta.prefill_query_start_loc,
            scale,
            max_query_len=meta.prefill_max_query_len,
            max_seq_len=meta.prefill_max_seq_len,
            window=window,
        )


def get_attention_backend(name: str, device: torch.device) -> PagedAttention:
    """``auto`` is Triton on CUDA, and on the CPU the C kernels where they build (else the
    torch reference, with a warning)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else _cpu_backend()
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_BACKENDS)}")
    module = importlib.import_module(_BACKENDS[name])
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on the CPU, not on {device}")
    if name == "cpu" and module.build_error():
        raise RuntimeError(f"the cpu attention backend is unavailable: {module.build_error()}")
    if name == "triton" and not getattr(module, "TRITON_AVAILABLE", False):
        raise RuntimeError(
            "the triton attention backend needs the `triton` package (pip install triton); "
            "on a machine without a GPU set TRITON_INTERPRET=1 to run it in the interpreter"
        )
    return PagedAttention(module, name)


def _cpu_backend() -> str:
    from pdserve.kernels import attention_cpu

    if attention_cpu.available():
        return "cpu"
    logger.warning(
        "the CPU attention kernels do not build here (%s); using the slower torch reference",
        attention_cpu.build_error(),
    )
    return "torch"
