"""Decode steps as CUDA graphs: one captured per batch-size bucket at start, replayed after.

nano-vllm's scheme. A decode batch of B sequences is padded to the smallest bucket >= B
(padding rows: slot -1, context length 0), its inputs are written into the persistent
buffers the graph was captured on (``StepInputs``), the graph replays, and the first B
rows of its output are the step's hidden states. The attention kernels are captured with
the split-K plan of the longest context the cache allows, so one graph serves every
context length. Buckets share one memory pool, largest captured first.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.forward_context import ForwardContext, forward_context
from pdserve.engine.step_inputs import StepInputs

logger = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (which is always a bucket)."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return sorted({*small, *range(16, max_num_seqs, 16), max_num_seqs})


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``num_seqs`` rows; None when none does."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


class CudaGraphRunner:
    """The captured decode graphs of one model over one set of persistent inputs."""

    def __init__(
        self,
        model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        inputs: StepInputs,
        context: Callable[[AttentionMetadata], ForwardContext],
        buckets: list[int],
    ) -> None:
        self.buckets = buckets
        self.inputs = inputs
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = None
        for b in reversed(buckets):
            step = inputs.prepare([], [], pad_decode_to=b)
            meta = step.meta
            meta.decode_max_seq_len = 0  # kernels plan for the longest context the table holds
            # Inference mode as in ``execute``: no autograd state is recorded into the graph.
            with torch.inference_mode(), forward_context(context(meta)):
                model(inputs.input_ids[:b], inputs.positions[:b])  # warm up: compile kernels
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[b] = model(inputs.input_ids[:b], inputs.positions[:b])
            pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info(
            "captured %d decode CUDA graphs (batch %s) in %.1f s, %.0f MiB",
            len(buckets),
            ",".join(map(str, buckets)),
            time.perf_counter() - started,
            used / 2**20,
        )

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the graph of ``bucket`` on what the inputs hold now: [bucket, hidden]."""
        self._graphs[bucket].replay()
        return self._outputs[bucket]
