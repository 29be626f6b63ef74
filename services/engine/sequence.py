"""A request inside the engine: its tokens, its progress and its blocks."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from pdserve.core.finish_reason import FinishReason
from pdserve.core.sampling import SamplingParams, TokenLogprobs
from pdserve.core.spec_stats import SpecDecodeStats
from pdserve.kv.hashing import BlockHash


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


_counter = itertools.count()


@dataclass
class RequestTimes:
    """When a request passed each point of its life in this engine (``time.time()``
    seconds), for its metrics and spans. Written by the engine thread only; read by the
    worker once the request has finished."""

    arrival: float = field(default_factory=time.time)  # taken in (add_request, begin_import)
    queued: float = 0.0  # joined the waiting queue (an import: once its blocks were in)
    scheduled: float | None = None  # first scheduled
    first_token: float | None = None  # the first token this engine sampled for it
    finished: float | None = None
    # The steps that computed its prompt, up to its first token: (start, end, tokens).
    chunks: list[tuple[float, float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.queued = self.queued or self.arrival

    def step(self, start: float, end: float, num_tokens: int, sampled: bool) -> None:
        """Record one step that computed ``num_tokens`` of the request (and sampled one)."""
        if self.scheduled is None:
            self.scheduled = start
        if self.first_token is None:
            self.chunks.append((start, end, num_tokens))
            if sampled:
                self.first_token = end


@dataclass(eq=False)
class Sequence:
    """Mutable engine-side state of one request.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache; the
    scheduler advances it for prefill, chunked prefill and decode alike.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Leading block table entries given back, out of every layer's window (KVCacheManager).
    num_released_blocks: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None
    arrival: int = field(default_factory=lambda: next(_counter))
    num_preemptions: int = 0
    # Prefill workers: finish after the first token (FinishReason.PREFILLED) and keep the
    # prompt's blocks until they are exported.
    prefill_only: bool = False
    num_imported_tokens: int = 0
    error: object | None = None  # a RequestError when finish_reason is ERROR
    times: RequestTimes = field(default_factory=RequestTimes)
    # Verifications since its last stream message, for the gateway's counters.
    spec_pending: SpecDecodeStats | None = None
    # With params.structured_outputs: its matcher (a structured_output.GrammarState), which
    # follows every appended token.
    grammar: object | None = None
    # With params.prompt_logprobs, when this engine computes the prompt: the logprobs of
    # prompt tokens 1.. as computed so far (None: not asked for, or prefilled elsewhere).
    prompt_logprobs: list[TokenLogprobs] | None = None

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        """Record a sampled token (and its logprobs, if the request asked for them).

        Raises ValueError, appending nothing, for a token the request's grammar refuses
        (only a token from outside can be one: sampled ones are masked by it)."""
        if self.grammar is not None and not self.grammar.accept(token_id):
            raise ValueError(
                f"token {token_id} does not follow the request's structured output grammar"
            )
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """The finish reason after the last appended token, or None to go on.

        The one stop check of pdserve: a prefill worker's first token meets it here too.
        """
        last = self.output_token_ids[-1]
        p = self.params
        if self.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if last in p.stop_token_ids:
                return FinishReason.STOP
        if self.grammar is not None and self.grammar.is_terminated:
            return FinishReason.STOP  # its grammar is complete: nothing more may follow
        if self.num_output_tokens >= p.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return FinishReason.PREFILLED if self.prefill_only else None
