"""OpenTelemetry traces of a pdserve process: one trace per request across the services.

The gateway takes a W3C ``traceparent`` from a request's REST headers or gRPC metadata
(or starts a trace), and every call it makes carries its span's context in the call's
metadata: gateway -> prefill -> kvstore, gateway -> decode -> kvstore. Each service
continues the trace its caller sent (``from_grpc``) and passes its own span on
(``grpc_metadata``). Spans go to an OTLP/gRPC collector in batches, from a thread.

Tracing is configured once per process, at start (``configure``; ``run_service`` does it
from ``TracingSettings``). Off (no endpoint), this module imports nothing of OpenTelemetry:
``start_span`` returns the one shared ``NO_SPAN``, whose methods do nothing, so call sites
never test whether tracing is on and no span object is made per request.

Span methods are OpenTelemetry's (``set_attribute``, ``add_event``, ``end``, ``with``);
times are nanoseconds since the epoch (``time.time_ns()``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
SERVER, CLIENT, INTERNAL = "server", "client", "internal"
_ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_SHUTDOWN_WAIT_S = 3.0  # what a stopping service gives its last spans to leave


class _NoSpan:
    """The span of a process that does not trace (or of an unsampled request)."""

    __slots__ = ()

    def is_recording(self) -> bool:
        return False

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        pass

    def record_exception(self, exception: BaseException, *args: Any, **kwargs: Any) -> None:
        pass

    def end(self, end_time: int | None = None) -> None:
        pass

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


NO_SPAN = _NoSpan()


class _Tracing:
    """The process's tracer provider and what ``start_span`` needs of OpenTelemetry."""

    def __init__(self, endpoint: str, ratio: float, service: str, attributes: Mapping) -> None:
        from opentelemetry import context, trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = {**attributes}
        if not os.environ.get("OTEL_SERVICE_NAME"):  # the variable wins, as everywhere
            resource["service.name"] = service
        self.provider = TracerProvider(
            resource=Resource.create(resource), sampler=ParentBased(TraceIdRatioBased(ratio))
        )
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("pdserve")
        self.propagator = TraceContextTextMapPropagator()
        self.trace = trace
        self.context = context
        self.kinds = {
            SERVER: trace.SpanKind.SERVER,
            CLIENT: trace.SpanKind.CLIENT,
            INTERNAL: trace.SpanKind.INTERNAL,
        }

    def parent_context(self, parent: Any) -> Any:
        """An OpenTelemetry Context from a span, a Context, or None (a new trace)."""
        if parent is None or parent is NO_SPAN:
            return self.context.Context()  # not the thread's current span: explicit only
        if isinstance(parent, self.context.Context):
            return parent
        return self.trace.set_span_in_context(parent)


_active: _Tracing | None = None


def endpoint_of(flag: str | None) -> str | None:
    """The collector to send to: the flag, else the standard OTEL_* variables, else None;
    a bare HOST:PORT means plaintext (http://)."""
    endpoint = flag or next((os.environ[v] for v in _ENDPOINT_ENV if os.environ.get(v)), None)
    if endpoint is None or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    return endpoint if "://" in endpoint else f"http://{endpoint}"


def configure(
    endpoint: str | None, ratio: float, service: str, attributes: Mapping[str, Any] | None = None
) -> bool:
    """Trace this process to ``endpoint`` (OTLP/gRPC), sampling ``ratio`` of new traces;
    nothing when ``endpoint`` is None. ``service``: its ``service.name``. Whether it traces."""
    global _active
    if endpoint is None:
        return False
    _active = _Tracing(endpoint, ratio, service, attributes or {})
    logger.info("tracing to %s, sampling %.3g of new traces", endpoint, ratio)
    return True


def shutdown() -> None:
    """Send the spans still queued (waiting at most a few seconds) and stop tracing."""
    global _active
    active, _active = _active, None
    if active is None:
        return
    done = threading.Thread(target=active.provider.shutdown, name="trace-shutdown", daemon=True)
    done.start()
    done.join(_SHUTDOWN_WAIT_S)


def enabled() -> bool:
    """Whether this process traces."""
    return _active is not None


def start_span(
    name: str,
    parent: Any = None,
    *,
    kind: str = INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    start_time: int | None = None,
) -> Any:
    """A started span (end it, or use it in ``with``), or NO_SPAN when tracing is off.

    ``parent``: a span of this process, a context from ``from_grpc``/``from_headers`` (a
    caller's), or None for a new trace. ``start_time``: ns since the epoch (default: now).
    """
    active = _active
    if active is None:
        return NO_SPAN
    return active.tracer.start_span(
        name,
        context=active.parent_context(parent),
        kind=active.kinds[kind],
        attributes=attributes,
        start_time=start_time,
    )


def from_headers(headers: Mapping[str, str]) -> Any:
    """The caller's trace context in ``headers`` (case-insensitive; a REST request's), or
    None: without a ``traceparent``, or when tracing is off."""
    active = _active
    if active is None:
        return None
    carrier = {h: headers[h] for h in TRACE_HEADERS if headers.get(h)}
    return active.propagator.extract(carrier) if carrier else None


def from_grpc(metadata: Iterable[tuple[str, Any]] | None) -> Any:
    """The caller's trace context in a gRPC call's invocation metadata, or None."""
    if _active is None or not metadata:
        return None
    return from_headers({k: v for k, v in metadata if k in TRACE_HEADERS})


def grpc_metadata(span: Any) -> tuple[tuple[str, str], ...] | None:
    """Metadata that makes ``span`` the parent of the called service's spans; None when
    ``span`` is not recorded (tracing off, or the request not sampled)."""
    active = _active
    if active is None or not span.is_recording():
        return None
    carrier: dict[str, str] = {}
    active.propagator.inject(carrier, context=active.trace.set_span_in_context(span))
    return tuple(carrier.items())


def trace_id(span: Any) -> str:
    """``span``'s trace id in hex ("" when it is not recorded), for log lines."""
    if not span.is_recording():
        return ""
    return format(span.get_span_context().trace_id, "032x")


def end_error(span: Any, error: BaseException) -> None:
    """Mark ``span`` failed by ``error`` and end it."""
    if span.is_recording():
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


def seconds_ns(seconds: float) -> int:
    """A ``time.time()`` value in ns, for ``start_time`` and ``end``."""
    return int(seconds * 1e9)
