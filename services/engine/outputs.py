"""What the engine's layers hand each other and their callers, as typed values.

``ModelRunnerOutput``: one step's samples (runner -> scheduler). ``StepOutput``: what one
engine step did (engine -> its driver). ``RequestDelta``: one request's new tokens
(AsyncEngine -> a worker). ``EngineStats`` and ``EngineInfo``: counters and fixed facts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.finish_reason import FinishReason
from pdserve.core.sampling import TokenLogprobs
from pdserve.core.spec_stats import SpecDecodeStats
from pdserve.engine.sequence import RequestTimes, Sequence
from pdserve.kv.blocks import BlockLayout, ExportedBlock


@dataclass(frozen=True)
class RequestError:
    """Why the engine ended one request with ``FinishReason.ERROR``.

    ``invalid``: the request's own values made it fail (e.g. sampling parameters whose
    probabilities are not finite): the caller's fault, a 400. Otherwise a fault in the
    engine that hit this request only: a 500. Either way the other requests go on.
    ``engine_down``: the engine itself failed (its thread died or stalled), so no request
    on it can finish; the request may be retried on another worker (UNAVAILABLE).
    """

    message: str
    invalid: bool = False
    engine_down: bool = False


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's samples, index-aligned with the scheduled batch's sequences.

    ``token_ids[i]`` are the tokens ``batch.seqs[i]`` emits: none when its step was a prompt
    chunk that did not reach the prompt's end, one for a decode (or a prompt's last chunk),
    and for a request that speculated, its accepted drafts and the target's next token
    (1 to k+1). ``logprobs[i]`` the logprobs of each, when the request asked for them
    (else None each); ``errors[i]`` why its rows could not be sampled (its request ends
    with ERROR; None for every row when all went well).
    """

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]
    errors: list[RequestError | None] | None = None
    # Batch index -> the logprobs of the prompt tokens its chunk computed (requests that
    # asked for prompt_logprobs), each after those its earlier chunks computed.
    prompt_logprobs: dict[int, list[TokenLogprobs]] | None = None


@dataclass(frozen=True)
class StepOutput:
    """What one engine step did: the requests that got a token, and those that finished."""

    advanced: list[Sequence]
    finished: list[Sequence]


@dataclass(frozen=True)
class RequestDelta:
    """New tokens of one request after an engine step; ``finish_reason`` on the last one."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    num_imported_tokens: int = 0
    exported: list[ExportedBlock] | None = None  # a prefilled request: the prompt's blocks
    error: RequestError | None = None  # with finish_reason ERROR: why
    # With the finish reason: when the request passed each point in the engine.
    times: RequestTimes | None = None
    num_preemptions: int = 0
    spec: SpecDecodeStats | None = None  # the verifications behind these tokens
    # On a request's first delta, when this engine computed its prompt_logprobs.
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class EngineStats:
    """Counters a user, a test or a registry heartbeat reads: cache hits, preemptions, blocks."""

    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_running: int
    num_waiting: int
    num_imported_blocks: int = 0
    num_imported_bytes: int = 0
    num_prefix_imported_blocks: int = 0  # prefix blocks a shared tier supplied
    num_rejected_blocks: int = 0  # fetched with a wrong header, length or checksum
    # Speculative decoding (vLLM's spec_decode_* counters); zero without it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # Tensor parallel: (rank, blocks, bytes) each rank imported into its own KV cache (its
    # heads of each block), as the rank counted them; empty at one rank.
    rank_imports: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, fixed at start: safe to read from any thread."""

    model_name: str
    fingerprint: bytes
    layout: BlockLayout
    num_total_blocks: int
    max_num_seqs: int
    max_model_len: int
