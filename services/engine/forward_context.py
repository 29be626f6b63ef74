"""What one forward pass reads besides its token ids and positions: the KV caches, the
attention metadata of the step, and the model's CPU linear kernels.

The model runner sets it around every forward (``with forward_context(ctx): ...``); the
custom ops the model calls (``pdserve::paged_attention``, ``pdserve::cpu_linear``) look
it up. This keeps those ops opaque to ``torch.compile`` and CUDA graph capture: a compiled
or captured model takes two tensors, and what changes from step to step lives in
persistent buffers that the context points at (nano-vllm's ``set_context``, vLLM's
forward context).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.attention import AttentionMetadata, PagedAttention


@dataclass
class ForwardContext:
    """The state a step's attention and linear ops read."""

    attention: PagedAttention
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata | None = None
    linears: Sequence[object] = field(default_factory=list)


class _Stack(threading.local):
    """Per thread: each engine steps on its own thread."""

    def __init__(self) -> None:
        self.contexts: list[ForwardContext] = []


_stack = _Stack()


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` the context of the forward passes this thread runs inside the block."""
    _stack.contexts.append(ctx)
    try:
        yield ctx
    finally:
        _stack.contexts.pop()


def get_forward_context() -> ForwardContext:
    if not _stack.contexts:
        raise RuntimeError("bug: a model op ran outside a forward_context")
    return _stack.contexts[-1]
