"""A step's flat model inputs, written into buffers allocated once (no per-step tensors).

Rows are the step's tokens: decode sequences first (one token each), then prefill chunks
and sequences that speculated (their last token and its drafts, all of them sampled).
``StepInputs.prepare`` fills the host buffers with numpy slices, then (on CUDA) copies the
used prefix to persistent device buffers in one transfer each; CUDA graphs and compiled
models read those same device tensors every step. Padding rows (a decode batch rounded up
to its bucket) have slot -1 (the KV write skips them) and context length 0 (attention
leaves them at zero), so whatever they compute is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.sequence import Sequence


@dataclass(frozen=True)
class PreparedStep:
    """What ``prepare`` wrote for one step, and where its rows are."""

    num_tokens: int  # rows, padding included
    num_decode: int  # decode rows, padding included
    num_real_decode: int
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [num_sampled] row of each sampled sequence's last token
    # Batch index of each sampled row, in logit_rows order; a sequence with drafts has one
    # row per scored position, in order.
    sample_order: list[int]
    # Rows whose logits give prompt logprobs: (batch index, first row, its position, rows),
    # each row the position before a prompt token that request has no logprob of yet.
    prompt_rows: tuple[tuple[int, int, int, int], ...] = ()
    # (tokens, decode rows, real decode rows, prefill sequences, sampled rows, longest
    # prefill query, longest prefill context): what ``StepInputs.snapshot`` sends.
    counts: tuple[int, ...] = ()


class StepInputs:
    """Persistent input buffers for up to ``max_tokens`` rows and ``max_seqs`` sequences."""

    def __init__(
        self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int, device
    ) -> None:
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.device = torch.device(device)
        pin = self.device.type == "cuda"

        def host(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

        self._host = {
            "input_ids": host(max_tokens, dtype=torch.int64),
            "positions": host(max_tokens, dtype=torch.int64),
            "slot_mapping": host(max_tokens, dtype=torch.int64),
            "block_tables": host(max_seqs, max_blocks, dtype=torch.int32),
            "seq_lens": host(max_seqs, dtype=torch.int32),
            "query_start_loc": host(max_seqs + 1, dtype=torch.int32),
            "logit_rows": host(max_tokens, dtype=torch.int64),
        }
        self._np = {k: v.numpy() for k, v in self._host.items()}
        if self.device.type == "cpu":
            self._dev = self._host
        else:
            self._dev = {k: torch.zeros_like(v, device=self.device) for k, v in self._host.items()}

    # Device views a captured or compiled model reads (stable storage).
    @property
    def input_ids(self) -> torch.Tensor:
        return self._dev["input_ids"]

    @property
    def positions(self) -> torch.Tensor:
        return self._dev["positions"]

    def prepare(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        pad_decode_to: int = 0,
        draft_token_ids: dict[str, list[int]] | None = None,
    ) -> PreparedStep:
        """Write the rows of ``seqs`` (advancing by ``num_new_tokens``); decode rows first,
        padded with dummy decode rows up to ``pad_decode_to``. A sequence with drafts
        (``draft_token_ids``, by request id) writes its last token and its drafts."""
        bs = self.block_size
        npy = self._np
        ids, pos, slots = npy["input_ids"], npy["positions"], npy["slot_mapping"]
        tables, lens, qsl = npy["block_tables"], npy["seq_lens"], npy["query_start_loc"]
        decode = [i for i, n in enumerate(num_new_tokens) if n == 1]
        prefill = [i for i, n in enumerate(num_new_tokens) if n != 1]
        num_decode = max(len(decode), pad_decode_to)
        num_tokens = num_decode + sum(num_new_tokens[i] for i in prefill)
        if num_tokens > self.max_tokens or num_decode + len(prefill) > self.max_seqs:
            raise RuntimeError(
                f"bug: a step of {num_tokens} tokens / {num_decode + len(prefill)} sequences "
                f"exceeds the input buffers ({self.max_tokens} / {self.max_seqs})"
            )
        sampled: list[tuple[int, int]] = []  # (row, batch index)
        prompt_rows: list[tuple[int, int, int, int]] = []
        for row, i in enumerate(decode):
            seq = seqs[i]
            p = seq.num_computed_tokens
            table = seq.block_table
            ids[row] = seq.token_ids[p]
            pos[row] = p
            slots[row] = table[p // bs] * bs + p % bs
            tables[row, : len(table)] = table
            lens[row] = p + 1
            if p + 1 == seq.num_tokens:  # else a one-token chunk inside a prompt
                sampled.append((row, i))
            if seq.prompt_logprobs is not None:
                _want_prompt_rows(prompt_rows, seq, i, row, p, p + 1)
        pad = slice(len(decode), num_decode)
        ids[pad], pos[pad], slots[pad], lens[pad] = 0, 0, -1, 0
        row = num_decode
        qsl[0] = 0
        max_q = max_len = 0
        for k, i in enumerate(prefill):
            seq, n = seqs[i], num_new_tokens[i]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            table = np.asarray(seq.block_table, dtype=np.int64)
            p = np.arange(start, end)
            drafts = draft_token_ids.get(seq.request_id) if draft_token_ids else None
            if drafts:  # the last token and its drafts: every row is sampled
                ids[row : row + n] = [seq.token_ids[start], *drafts]
                sampled.extend((row + j, i) for j in range(n))
            else:
                ids[row : row + n] = seq.token_ids[start:end]
                if seq.prompt_logprobs is not None:
                    _want_prompt_rows(prompt_rows, seq, i, row, start, end)
            pos[row : row + n] = p
            slots[row : row + n] = table[p // bs] * bs + p % bs
            tables[num_decode + k, : len(table)] = table
            lens[num_decode + k] = end
            qsl[k + 1] = qsl[k] + n
            max_q, max_len = max(max_q, n), max(max_len, end)
            row += n
            if end == seq.num_tokens and not drafts:
                sampled.append((row - 1, i))
        rows = npy["logit_rows"]
        rows[: len(sampled)] = [r for r, _ in sampled]
        counts = (num_tokens, num_decode, len(decode), len(prefill), len(sampled), max_q, max_len)
        return self._finish(counts, [i for _, i in sampled], tuple(prompt_rows))

    def _finish(
        self,
        counts: tuple[int, ...],
        sample_order: list[int],
        prompt_rows: tuple[tuple[int, int, int, int], ...],
    ) -> PreparedStep:
        """Upload the host buffers' rows and describe them."""
        num_tokens, num_decode, num_real_decode, num_prefill, num_sampled, max_q, max_len = counts
        self._upload(num_tokens, num_decode + num_prefill, num_prefill, num_sampled)
        dev = self._dev
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"][:num_tokens], num_decode_tokens=num_decode
        )
        if num_decode:
            meta.decode_block_tables = dev["block_tables"][:num_decode]
            meta.decode_seq_lens = dev["seq_lens"][:num_decode]
            meta.decode_max_seq_len = int(self._np["seq_lens"][:num_decode].max())
        if num_prefill:
            meta.prefill_block_tables = dev["block_tables"][num_decode : num_decode + num_prefill]
            meta.prefill_seq_lens = dev["seq_lens"][num_decode : num_decode + num_prefill]
            meta.prefill_query_start_loc = dev["query_start_loc"][: num_prefill + 1]
            meta.prefill_max_query_len = max_q
            meta.prefill_max_seq_len = max_len
        return PreparedStep(
            num_tokens=num_tokens,
            num_decode=num_decode,
            num_real_decode=num_real_decode,
            meta=meta,
            logit_rows=dev["logit_rows"][:num_sampled],
            sample_order=sample_order,
            prompt_rows=prompt_rows,
            counts=counts,
        )

    def snapshot(self, step: PreparedStep) -> dict:
        """The rows ``prepare`` wrote for ``step``, as arrays: what another rank's
        ``restore`` needs to run the same step (a tensor-parallel follower)."""
        num_tokens, num_decode, _, num_prefill, num_sampled, _, _ = step.counts
        num_seqs = num_decode + num_prefill
        npy = self._np
        longest = int(npy["seq_lens"][:num_seqs].max()) if num_seqs else 0
        cols = -(-longest // self.block_size)
        return {
            "counts": step.counts,
            "prompt_rows": step.prompt_rows,
            "input_ids": npy["input_ids"][:num_tokens].copy(),
            "positions": npy["positions"][:num_tokens].copy(),
            "slot_mapping": npy["slot_mapping"][:num_tokens].copy(),
            "block_tables": npy["block_tables"][:num_seqs, :cols].copy(),
            "seq_lens": npy["seq_lens"][:num_seqs].copy(),
            "query_start_loc": npy["query_start_loc"][: num_prefill + 1].copy(),
            "logit_rows": npy["logit_rows"][:num_sampled].copy(),
        }

    def restore(self, snap: dict) -> PreparedStep:
        """Write a ``snapshot`` of another rank's step into these buffers."""
        npy = self._np
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc"):
            npy[name][: len(snap[name])] = snap[name]
        tables = snap["block_tables"]
        npy["block_tables"][: tables.shape[0], : tables.shape[1]] = tables
        npy["logit_rows"][: len(snap["logit_rows"])] = snap["logit_rows"]
        return self._finish(tuple(snap["counts"]), [], tuple(snap["prompt_rows"]))

    def _upload(self, num_tokens: int, num_seqs: int, num_prefill: int, num_sampled: int):
        if self._dev is self._host:
            return
        for name, n in (
            ("input_ids", num_tokens),
            ("positions", num_tokens),
            ("slot_mapping", num_tokens),
            ("block_tables", num_seqs),
            ("seq_lens", num_seqs),
            ("query_start_loc", num_prefill + 1),
            ("logit_rows", num_sampled),
        ):
            self._dev[name][:n].copy_(self._host[name][:n], non_blocking=True)


def _want_prompt_rows(
    out: list[tuple[int, int, int, int]],
    seq: Sequence,
    index: int,
    row: int,
    start: int,
    end: int,
) -> None:
    """Add the rows of positions [start, end), written from ``row`` on, whose logits give a
    prompt token's logprob that ``seq`` has not had yet (position p predicts token p + 1)."""
    first = max(start, len(seq.prompt_logprobs))
    last = min(end, seq.num_prompt_tokens - 1)
    if first < last:
        out.append((index, row + first - start, first, last - first))
