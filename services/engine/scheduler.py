"""Continuous batching: decide each step which sequences advance, and by how many tokens.

Prefill, chunked prefill and decode are one operation here: advance a sequence's
``num_computed_tokens`` towards ``num_tokens`` within the step's token budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine.kv_cache_manager import KVCacheManager
from services.engine.outputs import ModelRunnerOutput
from services.engine.sequence import PREFILLED, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int


@dataclass
class ScheduledBatch:
    """What one step computes: ``num_new_tokens[i]`` tokens of ``seqs[i]``."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Running sequences first (in admission order), then waiting ones, under the budget."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work; preempt the most recently admitted sequence when blocks run out."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            imported = bool(seq.block_table)
            if imported:  # KV imported from another worker: continue from there
                hits, num_hit_tokens = [], seq.num_computed_tokens
            else:
                hits = self.kv_cache.get_computed_blocks(seq)
                num_hit_tokens = len(hits) * self.kv_cache.block_size
            n = min(seq.num_tokens - num_hit_tokens, budget)
            if not self.kv_cache.allocate_slots(seq, n, hits):
                break
            self.waiting.popleft()
            if not imported:  # an import counted its own lookup
                self.kv_cache.record_lookup(seq.num_tokens, num_hit_tokens)
            seq.num_computed_tokens = num_hit_tokens
            if seq.num_preemptions == 0 and not seq.num_imported_tokens:
                seq.num_cached_tokens = num_hit_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, batch: ScheduledBatch, output: ModelRunnerOutput) -> list[Sequence]:
        """Advance the batch by its computed tokens, append sampled ones; return the finished."""
        finished = []
        errors = output.errors or [None] * len(batch.seqs)
        for seq, n, token, logprobs, error in zip(
            batch.seqs, batch.num_new_tokens, output.token_ids, output.logprobs, errors, strict=True
        ):
            seq.num_computed_tokens += n
            self.kv_cache.cache_full_blocks(seq)
            if error is not None:  # this request only: the others go on
                seq.error = error
                self._finish(seq, "error")
                finished.append(seq)
                continue
            if token is None:
                continue
            seq.append_token(token, logprobs)
            reason = seq.check_stop(self.config.max_model_len)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        if finished:
            self.running = [s for s in self.running if not s.is_finished]
        return finished

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if reason != PREFILLED:  # a prefilled request's blocks wait for their export
            self.kv_cache.free(seq)

    def finish_now(self, seq: Sequence, reason: str) -> None:
        """Finish a sequence that is in no queue (e.g. done on arrival)."""
        self._finish(seq, reason)

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request wherever it is and free its blocks at once."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        return None
