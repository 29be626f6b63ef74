"""A real OTLP/gRPC trace receiver for tests and benchmarks: OpenTelemetry's own
``TraceService`` messages, served by grpc on 127.0.0.1, keeping every span it receives."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, flattened: ids in hex, attributes as Python values."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict = field(hash=False)
    events: tuple[str, ...] = ()
    status_code: int = 0

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: OtlpCollector) -> None:
        self.collector = collector

    def Export(self, request, context):  # noqa: N802 (gRPC's name)
        spans = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    spans.append(
                        ReceivedSpan(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=tuple(e.name for e in s.events),
                            status_code=s.status.code,
                        )
                    )
        self.collector.add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpCollector:
    """Start on a free port of 127.0.0.1; ``endpoint`` is what services are given."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Receiver(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)
            self._lock.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(self, predicate, timeout: float, what: str = "spans") -> list[ReceivedSpan]:
        """The spans once ``predicate(spans)`` holds; AssertionError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate(self._spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self._spans})
                    raise AssertionError(f"no {what} within {timeout} s; received {names}")
                self._lock.wait(left)
            return list(self._spans)

    def stop(self) -> None:
        self._server.stop(grace=None)
