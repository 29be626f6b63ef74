"""Turns a scheduled batch into flat tensors, runs the model over the paged KV cache, samples."""

from __future__ import annotations

import itertools
import logging
import warnings

import torch

from services.common.config import EngineArgs
from services.common.model import ModelConfig
from services.engine.attention import AttentionMetadata, get_attention_backend
from services.engine.model.cpu_packing import (
    buckets_for,
    mkl_packing_available,
    pack_linears,
)
from services.engine.model.loader import load_model
from services.engine.outputs import ModelRunnerOutput
from services.engine.sampler import Sampler
from services.engine.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the weights and the KV cache tensor; one ``execute`` per engine step."""

    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        num_blocks: int,
    ) -> None:
        self.cfg = model_config
        self.dtype = dtype
        self.device = device
        self.block_size = args.block_size
        self.attn = get_attention_backend(args.attention_backend, device)
        self.model = load_model(model_config, self.attn, dtype, device, max_model_len)
        if device.type == "cpu" and dtype == torch.float32 and mkl_packing_available():
            pack_linears(self.model, buckets_for(args.max_num_seqs))
        # One contiguous region per block, all layers together: a block exports as one buffer.
        # kv: [num_blocks, num_layers, 2 (k, v), num_kv_heads, block_size, head_dim]
        # Kernels see each layer as [num_blocks, block_size, num_kv_heads, head_dim] views
        # (strided); head-major storage lets the CPU path gather a head's block in one copy.
        self.kv = torch.zeros(
            num_blocks,
            model_config.num_layers,
            2,
            model_config.num_kv_heads,
            self.block_size,
            model_config.head_dim,
            dtype=dtype,
            device=device,
        )
        self.kv_caches = [
            (self.kv[:, i, 0].transpose(1, 2), self.kv[:, i, 1].transpose(1, 2))
            for i in range(model_config.num_layers)
        ]
        self.sampler = Sampler(args.seed)

    def read_block(self, block_id: int) -> bytes:
        """A block's KV for all layers as one buffer: [layers, 2, kv_heads, block_size, head_dim]."""
        return self.kv[block_id].cpu().view(torch.uint8).numpy().tobytes()

    def write_block(self, block_id: int, data: bytes) -> None:
        """Fill a block from a buffer made by ``read_block`` on a worker with the same layout."""
        dst = self.kv[block_id].view(torch.uint8)
        if len(data) != dst.numel():
            raise ValueError(
                f"block data has {len(data)} bytes, this worker's blocks have {dst.numel()}"
            )
        with warnings.catch_warnings():  # read-only use of an immutable buffer
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(data, dtype=torch.uint8)
        dst.copy_(src.view(dst.shape))

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one KV block (all layers, K and V)."""
        return block_size * cfg.kv_bytes_per_token(dtype.itemsize)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Run one step over ``batch``; its samples, index-aligned with ``batch.seqs``."""
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] != 1)
        inputs = self._prepare(batch, order)
        input_ids, positions, meta, logit_rows, sample_idx = inputs
        hidden = self._run_model(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden[logit_rows])
        seqs = [batch.seqs[i] for i in sample_idx]
        tokens, logprobs = self.sampler(logits, seqs)
        output = ModelRunnerOutput([None] * len(batch.seqs), [None] * len(batch.seqs))
        for k, i in enumerate(sample_idx):
            output.token_ids[i] = tokens[k]
            output.logprobs[i] = logprobs[k]
        return output

    def _run_model(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # The one place that would choose a CUDA graph replay over eager execution.
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _prepare(self, batch: ScheduledBatch, order: list[int]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        sample_idx: list[int] = []
        dec_tables, dec_lens = [], []
        pre_tables, pre_lens, pre_qsl = [], [], [0]
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                dec_tables.append(table)
                dec_lens.append(end)
            else:
                pre_tables.append(table)
                pre_lens.append(end)
                pre_qsl.append(pre_qsl[-1] + n)
            if end == seq.num_tokens:
                logit_rows.append(len(input_ids) - 1)
                sample_idx.append(i)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=len(dec_lens),
        )
        if dec_lens:
            meta.decode_block_tables = _pad_tables(dec_tables, dev)
            meta.decode_seq_lens = torch.tensor(dec_lens, dtype=torch.int32, device=dev)
            meta.decode_max_seq_len = max(dec_lens)
        if pre_lens:
            meta.prefill_block_tables = _pad_tables(pre_tables, dev)
            meta.prefill_seq_lens = torch.tensor(pre_lens, dtype=torch.int32, device=dev)
            meta.prefill_query_start_loc = torch.tensor(pre_qsl, dtype=torch.int32, device=dev)
            meta.prefill_max_query_len = max(b - a for a, b in itertools.pairwise(pre_qsl))
            meta.prefill_max_seq_len = max(pre_lens)
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            torch.tensor(logit_rows, dtype=torch.int64, device=dev),
            sample_idx,
        )


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables padded with 0 to one width: [num_seqs, max_blocks] int32."""
    width = max(len(t) for t in tables)
    return torch.tensor(
        [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
    )
