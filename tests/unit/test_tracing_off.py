"""Tracing off costs nothing (no OpenTelemetry import, one shared no-op span); the endpoint
comes from the flag or the standard OTEL_* variables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdserve.runtime import tracing

ROOT = Path(__file__).resolve().parents[2]

OFF = """
import sys
from pdserve.runtime import tracing
span = tracing.start_span("x", tracing.from_headers({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}))
with span as inner:
    inner.set_attribute("k", 1)
assert span is tracing.NO_SPAN and not span.is_recording()
assert tracing.grpc_metadata(span) is None and tracing.trace_id(span) == ""
assert tracing.from_grpc([("traceparent", "x")]) is None
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""


def test_off_imports_nothing_of_opentelemetry_and_hands_out_one_no_op_span():
    out = subprocess.run(
        [sys.executable, "-c", OFF], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_endpoint_is_the_flag_else_the_standard_variables(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    assert tracing.endpoint_of(None) is None
    assert tracing.endpoint_of("collector:4317") == "http://collector:4317"  # plaintext
    assert tracing.endpoint_of("https://collector:4317") == "https://collector:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://all:4317")
    assert tracing.endpoint_of(None) == "http://all:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    assert tracing.endpoint_of(None) == "http://traces:4317"
    assert tracing.endpoint_of("http://flag:4317") == "http://flag:4317"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.endpoint_of("http://flag:4317") is None
