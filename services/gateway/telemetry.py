"""One request at the gateway, measured: its ``llm_request`` span (the root of its trace,
or the child of the caller's ``traceparent``), its phases (tokenize, admission), and the
client-side latencies of each of its choices (TTFT from the request's arrival, the gaps
between tokens, end to end), which go to the gateway's histograms, the span's gen_ai
attributes and the request's log line."""

from __future__ import annotations

import time
from typing import Any

from pdserve.core.finish_reason import FinishReason
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.runtime import tracing
from pdserve.v1 import common_pb2


def request_attributes(
    request_id: str, model_name: str, client_request_id: str, operation: str
) -> dict[str, Any]:
    """The ``llm_request`` span's attributes known on arrival."""
    out = {
        "gen_ai.request.id": request_id,
        "gen_ai.response.model": model_name,
        "pdserve.operation": operation,
    }
    if client_request_id:
        out["pdserve.client_request_id"] = client_request_id
    return out


class RequestTelemetry:
    """The clock and span of one REST or gRPC request (all its choices).

    ``arrival``: ``time.perf_counter()`` when the request reached the gateway; the span
    starts then (``arrival_ns``, epoch ns). ``metrics`` None: nothing is observed (a
    front built without a registry, in tests).
    """

    def __init__(
        self,
        metrics: GatewayMetrics | None,
        parent: Any = None,
        *,
        arrival: float | None = None,
        arrival_ns: int | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.span = tracing.start_span(
            "llm_request", parent, kind=tracing.SERVER, start_time=arrival_ns
        )
        if attributes and self.span.is_recording():
            self.span.set_attributes(attributes)
        self.trace_id = tracing.trace_id(self.span)
        self.first_token_at: float | None = None
        self.usage = common_pb2.Usage()
        self.finish_reasons: list[FinishReason] = []
        self._ended = False

    def phase(self, name: str) -> Any:
        """A child span ``gateway.NAME`` (end it, or use it in ``with``)."""
        return tracing.start_span(f"gateway.{name}", self.span)

    def admitted(self, waited_s: float) -> None:
        """The request got its admission slot after ``waited_s`` seconds in the queue."""
        if self.metrics is not None:
            self.metrics.requests.queue.observe(waited_s)
        self.span.set_attribute("gen_ai.latency.time_in_queue", waited_s)

    def prepared(self, params: common_pb2.SamplingParams, prompt_tokens: int, n: int) -> None:
        """The request's sampling parameters and prompt, once tokenized."""
        if self.metrics is not None:
            self.metrics.params_n.observe(n)
        if self.span.is_recording():
            self.span.set_attributes(
                {
                    "gen_ai.request.max_tokens": params.max_tokens,
                    "gen_ai.request.temperature": params.temperature,
                    "gen_ai.request.top_p": params.top_p,
                    "gen_ai.request.n": n,
                    "gen_ai.usage.prompt_tokens": prompt_tokens,
                }
            )

    def choice(self) -> ChoiceTelemetry:
        """The clock of one choice (one ``generation.generate``)."""
        return ChoiceTelemetry(self)

    def end(self, error: BaseException | None = None) -> None:
        """The response is complete (or failed, or the client left): end the span, once."""
        if self._ended:
            return
        self._ended = True
        span = self.span
        if span.is_recording():
            span.set_attributes(
                {
                    "gen_ai.usage.completion_tokens": self.usage.completion_tokens,
                    "gen_ai.usage.num_sequences": len(self.finish_reasons),
                    "gen_ai.latency.e2e": time.perf_counter() - self.arrival,
                    "pdserve.cached_tokens": self.usage.cached_prompt_tokens,
                    "pdserve.finish_reasons": self.finish_reasons,
                }
            )
            if self.first_token_at is not None:
                ttft = self.first_token_at - self.arrival
                span.set_attribute("gen_ai.latency.time_to_first_token", ttft)
        if error is None:
            span.end()
        else:
            tracing.end_error(span, error)


class ChoiceTelemetry:
    """One choice's tokens as they reach the gateway: TTFT, inter-token gaps, e2e."""

    def __init__(self, request: RequestTelemetry) -> None:
        self.request = request
        self.first: float | None = None
        self.last: float | None = None

    def tokens(self) -> None:
        """An event with new tokens arrived from the workers."""
        now = time.perf_counter()
        request, metrics = self.request, self.request.metrics
        if self.first is None:
            self.first = now
            if request.first_token_at is None or now < request.first_token_at:
                request.first_token_at = now
            if metrics is not None:
                metrics.requests.ttft.observe(now - request.arrival)
        elif metrics is not None:
            metrics.requests.itl.observe(now - self.last)
        self.last = now

    def finish(
        self, usage: common_pb2.Usage, finish_reason: FinishReason
    ) -> tuple[float | None, float]:
        """The choice ended: count it; its (TTFT or None, e2e) in seconds."""
        request, metrics = self.request, self.request.metrics
        e2e = time.perf_counter() - request.arrival
        ttft = None if self.first is None else self.first - request.arrival
        request.usage.prompt_tokens = usage.prompt_tokens
        request.usage.completion_tokens += usage.completion_tokens
        request.usage.cached_prompt_tokens = max(
            request.usage.cached_prompt_tokens, usage.cached_prompt_tokens
        )
        request.finish_reasons.append(finish_reason)
        if metrics is not None:
            r = metrics.requests
            r.e2e.observe(e2e)
            r.finished(finish_reason)
            r.tokens(usage.prompt_tokens, usage.completion_tokens)
            metrics.cached_tokens.inc(usage.cached_prompt_tokens)
            if usage.completion_tokens > 1 and self.first is not None:
                r.tpot.observe((self.last - self.first) / (usage.completion_tokens - 1))
        return ttft, e2e
