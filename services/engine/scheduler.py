"""Continuous batching: decide each step which sequences advance, and by how many tokens.

Prefill, chunked prefill and decode are one operation here: advance a sequence's
``num_computed_tokens`` towards ``num_tokens`` within the step's token budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.core.finish_reason import FinishReason
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.outputs import ModelRunnerOutput, RequestError
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec_decode import SpecDecoder


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int


@dataclass
class ScheduledBatch:
    """What one step computes: ``num_new_tokens[i]`` tokens of ``seqs[i]``.

    A sequence in ``draft_token_ids`` (vLLM's ``scheduled_spec_decode_tokens``) advances by
    its last token and the drafts proposed after it, which are scored with it but are not
    yet part of its ``token_ids``; ``Scheduler.update`` keeps the ones verification accepted.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request id -> drafts
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Running sequences first (in admission order), then waiting ones, under the budget.

    With ``spec``, a running sequence past its prompt advances by its last token and the
    drafts proposed for it (when there are blocks and budget for them; else by its last
    token alone), and ``update`` keeps what verification accepted.
    """

    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager, spec: SpecDecoder | None = None
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.spec = spec
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
        proposals = self._proposals()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 1 and seq.request_id in proposals:
                drafts = proposals[seq.request_id][: budget - 1]
                if drafts and self.kv_cache.allocate_slots(seq, 1 + len(drafts)):
                    batch.draft_token_ids[seq.request_id] = drafts
                    batch.seqs.append(seq)
                    batch.num_new_tokens.append(1 + len(drafts))
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
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

    def _proposals(self) -> dict[str, list[int]]:
        """This step's drafts, for the running sequences past their prompts (none when
        speculation is off, or off at this batch size)."""
        if self.spec is None or not self.spec.begin_step(len(self.running)):
            return {}
        ready = [
            s
            for s in self.running
            if s.num_tokens - s.num_computed_tokens == 1 and self.spec.eligible(s)
        ]
        return self.spec.propose_all(ready) if ready else {}

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            imported = bool(seq.block_table)
            if imported:  # KV imported from another worker: continue from there
                hits, num_hit_tokens = [], seq.num_computed_tokens
            elif seq.prompt_logprobs is not None and seq.num_output_tokens == 0:
                hits, num_hit_tokens = [], 0  # every prompt position's logits are wanted
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
        """Advance the batch by its computed tokens, append sampled ones; return the finished.

        A sequence that speculated keeps the KV of its last token and of its accepted drafts
        only: the slots of rejected drafts are overwritten later, and blocks that held
        nothing else go back to the pool, before any full block is cached."""
        finished = []
        errors = output.errors or [None] * len(batch.seqs)
        drafts = batch.draft_token_ids
        for i, prompt_logprobs in (output.prompt_logprobs or {}).items():
            batch.seqs[i].prompt_logprobs.extend(prompt_logprobs)
        for seq, n, tokens, logprobs, error in zip(
            batch.seqs, batch.num_new_tokens, output.token_ids, output.logprobs, errors, strict=True
        ):
            num_drafts = len(drafts.get(seq.request_id, ()))
            if num_drafts:
                num_accepted = len(tokens) - 1 if error is None else 0
                self.spec.record(seq, num_drafts, num_accepted)
                n -= num_drafts - num_accepted
            seq.num_computed_tokens += n
            if error is not None:  # this request only: the others go on
                if not num_drafts:
                    self.kv_cache.cache_full_blocks(seq)
                seq.error = error
                self._finish(seq, FinishReason.ERROR)
                finished.append(seq)
                continue
            reason = None
            for token, lp in zip(tokens, logprobs, strict=True):
                try:
                    seq.append_token(token, lp)
                except ValueError as refused:  # a sampled token its grammar refuses: a bug
                    seq.error = RequestError(f"bug in the structured output mask: {refused}")
                    reason = FinishReason.ERROR
                    break
                reason = seq.check_stop(self.config.max_model_len)
                if reason is not None:
                    break
            if num_drafts:
                # Stopped at an accepted draft: the KV past the stop is not the request's.
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                self.kv_cache.trim(seq)
            self.kv_cache.cache_full_blocks(seq)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        if finished:
            self.running = [s for s in self.running if not s.is_finished]
        return finished

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if self.spec is not None:
            self.spec.forget(seq.request_id)
        # A prefilled request's blocks wait for their export.
        if reason is not FinishReason.PREFILLED:
            self.kv_cache.free(seq)

    def finish_now(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a sequence that is in no queue (e.g. done on arrival)."""
        self._finish(seq, reason)

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request wherever it is and free its blocks at once."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, FinishReason.ABORT)
                    return seq
        return None
