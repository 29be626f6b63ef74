"""What a prefill or decode worker tells about itself: its /metrics and its requests' spans.

Engine state (running, waiting, KV use, prefix-cache and preemption counters) is read from
the engine's stats snapshot when scraped; a request's latencies come from the times the
engine stamped on it (``RequestTimes``) and are observed once, when it ends, into vLLM's
histograms, and drawn as its spans (queue, prompt chunks, generation).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram

from pdserve.core.finish_reason import FinishReason
from pdserve.core.spec_stats import SpecDecodeStats
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.outputs import RequestDelta
from pdserve.engine.sequence import RequestTimes
from pdserve.runtime import tracing
from pdserve.runtime.metrics import (
    REQUEST_LATENCY_BUCKETS,
    TRANSFER_BUCKETS,
    Labels,
    RequestMetrics,
    SnapshotCollector,
    name,
    new_registry,
    spec_rows,
)

ns = tracing.seconds_ns


class WorkerMetrics:
    """One worker's registry: vLLM's engine and request series, and KV transfers."""

    def __init__(self, engine: AsyncEngine, role: str) -> None:
        info = engine.info
        self.engine = engine
        self.registry = new_registry()
        self.labels = labels = Labels(role, info.model_name)
        self.requests = RequestMetrics(self.registry, labels, info.max_model_len)
        self.phases = {
            phase: Histogram(
                name(f"request_{phase}_time_seconds"),
                text,
                labels.names,
                buckets=REQUEST_LATENCY_BUCKETS,
                registry=self.registry,
            ).labels(*labels.values)
            for phase, text in (
                ("prefill", "Time from a request's first step to its first token, in seconds."),
                ("decode", "Time from a request's first token to its last, in seconds."),
                ("inference", "Time from a request's first step to its last, in seconds."),
            )
        }
        by_direction = [*labels.names, "direction"]
        self.transfer_bytes = Counter(
            name("kv_transfer_bytes"),
            "Bytes of KV blocks sent to (push) or received from (fetch) kvstores, staged for "
            "(nixl_stage) or read over NIXL (nixl_read).",
            by_direction,
            registry=self.registry,
        )
        self.transfer_blocks = Counter(
            name("kv_transfer_blocks"),
            "KV blocks sent to (push) or received from (fetch) kvstores, staged for "
            "(nixl_stage) or read over NIXL (nixl_read).",
            by_direction,
            registry=self.registry,
        )
        self.transfer_seconds = Histogram(
            name("kv_transfer_seconds"),
            "Time of one request's KV transfer (all its kvstores), in seconds.",
            by_direction,
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self.transfer_failures = Counter(
            name("kv_transfer_failures"),
            "KV transfers to (push) or from (fetch) one kvstore, or NIXL reads (nixl_read) "
            "or stagings (nixl_stage: no slot free), that failed; their blocks come from "
            "the kvstore or are recomputed by the decode worker.",
            by_direction,
            registry=self.registry,
        )
        for direction in ("push", "fetch"):
            self.transfer_failures.labels(*labels.values, direction)
        self.registry.register(SnapshotCollector(labels, self._engine_rows))

    def _engine_rows(self) -> Iterable[tuple]:
        s = self.engine.stats
        used = s.num_total_blocks - s.num_free_blocks
        return (
            ("num_requests_running", "gauge", "Requests in the engine's batch.", s.num_running),
            ("num_requests_waiting", "gauge", "Requests queued in the engine.", s.num_waiting),
            (
                "kv_cache_usage_perc",
                "gauge",
                "Share of KV blocks held by requests (1 is all).",
                used / s.num_total_blocks if s.num_total_blocks else 0.0,
            ),
            ("kv_cache_blocks", "gauge", "KV blocks of the engine.", s.num_total_blocks),
            (
                "kv_cache_cached_blocks",
                "gauge",
                "Free KV blocks that still hold a prefix the cache can hit.",
                s.num_cached_blocks,
            ),
            (
                "prefix_cache_queries",
                "counter",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_cache_queries,
            ),
            (
                "prefix_cache_hits",
                "counter",
                "Prompt tokens found in the prefix cache.",
                s.prefix_cache_hits,
            ),
            (
                "num_preemptions",
                "counter",
                "Requests preempted (to be recomputed).",
                s.num_preemptions,
            ),
            (
                "kv_blocks_imported",
                "counter",
                "KV blocks computed elsewhere and taken into this engine's cache.",
                s.num_imported_blocks,
            ),
            (
                "kv_bytes_imported",
                "counter",
                "Bytes of the KV blocks imported.",
                s.num_imported_bytes,
            ),
            (
                "kv_blocks_rejected",
                "counter",
                "Fetched KV blocks refused (wrong header, length or checksum) and recomputed.",
                s.num_rejected_blocks,
            ),
            *_rank_rows(s.rank_imports),
            *spec_rows(
                SpecDecodeStats(
                    s.spec_num_drafts,
                    s.spec_num_draft_tokens,
                    s.spec_num_accepted_tokens,
                    list(s.spec_accepted_per_pos),
                )
            ),
        )

    def transfer(self, direction: str, blocks: int, num_bytes: int, seconds: float) -> None:
        """Count one request's KV transfer (``direction``: push, fetch, nixl_stage,
        nixl_read)."""
        values = (*self.labels.values, direction)
        self.transfer_blocks.labels(*values).inc(blocks)
        self.transfer_bytes.labels(*values).inc(num_bytes)
        self.transfer_seconds.labels(*values).observe(seconds)

    def transfer_failed(self, direction: str) -> None:
        """Count one failed transfer (``direction``: push, fetch, nixl_stage, nixl_read)."""
        self.transfer_failures.labels(*self.labels.values, direction).inc()


def _rank_rows(rank_imports: tuple[tuple[int, int, int], ...]) -> Iterable[tuple]:
    """Per tensor-parallel rank: the blocks and bytes it imported into its own KV cache
    (its KV heads of each block)."""
    for rank, blocks, num_bytes in rank_imports:
        label = {"rank": str(rank)}
        text = "KV blocks imported, by tensor-parallel rank (each takes its KV heads)."
        yield ("kv_rank_blocks_imported", "counter", text, label, blocks)
        text = "Bytes of KV imported, by tensor-parallel rank (its KV heads only)."
        yield ("kv_rank_bytes_imported", "counter", text, label, num_bytes)


@dataclass
class RequestRecord:
    """One request on a worker, from its arrival at the servicer to its last delta: what
    its metrics, span attributes and log need. ``first_token_here``: the engine samples the
    request's first token (prefill, or a colocated decode)."""

    metrics: WorkerMetrics
    span: object
    prompt_tokens: int
    first_token_here: bool
    generated: int = 0
    finish_reason: FinishReason | None = None
    fetched_at: float | None = None  # a handed-over request: when its blocks were fetched
    _last_delta_at: float | None = field(default=None, repr=False)

    def delta(self, delta: RequestDelta) -> None:
        """A delta streamed to the caller: its tokens, and the gap since the last one."""
        now = time.perf_counter()
        if delta.token_ids:
            if self._last_delta_at is not None:
                self.metrics.requests.itl.observe(now - self._last_delta_at)
            self._last_delta_at = now
            self.generated += len(delta.token_ids)

    def finish(self, last: RequestDelta) -> None:
        """The request ended with ``last``: observe its latencies, draw its engine spans."""
        self.finish_reason = last.finish_reason
        requests = self.metrics.requests
        requests.finished(last.finish_reason or FinishReason.ABORT)
        requests.tokens(self.prompt_tokens, self.generated)
        times = last.times
        if times is None or times.scheduled is None or times.finished is None:
            return  # ended before it ran (refused, or the engine failed)
        latency = phase_latencies(times, self.first_token_here)
        requests.queue.observe(latency["gen_ai.latency.time_in_queue"])
        requests.e2e.observe(latency["gen_ai.latency.e2e"])
        if "gen_ai.latency.time_to_first_token" in latency:
            requests.ttft.observe(latency["gen_ai.latency.time_to_first_token"])
        phases = self.metrics.phases
        phases["inference"].observe(latency["gen_ai.latency.time_in_model_inference"])
        if times.first_token is not None:
            phases["prefill"].observe(latency["gen_ai.latency.time_in_model_prefill"])
            phases["decode"].observe(latency["gen_ai.latency.time_in_model_decode"])
            if self.generated > 1 and self.first_token_here:
                requests.tpot.observe((times.finished - times.first_token) / (self.generated - 1))
        span = self.span
        if span.is_recording():
            span.set_attributes(latency)
            span.set_attributes(
                {
                    "gen_ai.usage.prompt_tokens": self.prompt_tokens,
                    "gen_ai.usage.completion_tokens": self.generated,
                    "pdserve.cached_tokens": last.num_cached_tokens,
                    "pdserve.num_preemptions": last.num_preemptions,
                    "pdserve.finish_reason": last.finish_reason or "",
                }
            )
            engine_spans(span, times, self.metrics.labels.role, self.fetched_at)

    def abandoned(self) -> None:
        """The caller went away (or the call failed) before the request finished."""
        if self.finish_reason is None:
            self.metrics.requests.finished(FinishReason.ABORT)


def request_attributes(request: object, worker_id: str) -> dict[str, object]:
    """A Prefill or Decode request's span attributes (its id, sampling parameters, this
    worker)."""
    params = request.params
    return {
        "gen_ai.request.id": request.request_id,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.usage.prompt_tokens": len(request.prompt_token_ids),
        "pdserve.worker.id": worker_id,
    }


def phase_latencies(times: RequestTimes, first_token_here: bool) -> dict[str, float]:
    """vLLM's latency breakdown of a finished request, as span attributes (seconds)."""
    out = {
        "gen_ai.latency.time_in_queue": times.scheduled - times.queued,
        "gen_ai.latency.time_in_model_inference": times.finished - times.scheduled,
        "gen_ai.latency.e2e": times.finished - times.arrival,
    }
    if times.first_token is not None:
        out["gen_ai.latency.time_in_model_prefill"] = times.first_token - times.scheduled
        out["gen_ai.latency.time_in_model_decode"] = times.finished - times.first_token
        if first_token_here:
            out["gen_ai.latency.time_to_first_token"] = times.first_token - times.arrival
    return out


def engine_spans(
    parent: object, times: RequestTimes, role: str, fetched_at: float | None = None
) -> None:
    """The request's life in the engine as children of ``parent``: ``ROLE.kv_import`` (a
    handed-over request, from its fetch to its place in the queue), ``ROLE.queue``, one
    ``ROLE.prefill_chunk`` per step that computed its prompt, and, past the first token,
    ``ROLE.generate``."""

    def child(span_name: str, start: float, end: float, **attributes: object) -> None:
        span = tracing.start_span(span_name, parent, start_time=ns(start), attributes=attributes)
        span.end(end_time=ns(end))

    if fetched_at is not None:
        child(f"{role}.kv_import", fetched_at, max(times.queued, fetched_at))
    child(f"{role}.queue", times.queued, times.scheduled)
    for i, (start, end, tokens) in enumerate(times.chunks):
        child(f"{role}.prefill_chunk", start, end, **{"pdserve.tokens": tokens, "pdserve.chunk": i})
    if times.first_token is not None:
        parent.add_event("first_token", timestamp=ns(times.first_token))
        if times.finished > times.first_token:
            child(f"{role}.generate", times.first_token, times.finished)
