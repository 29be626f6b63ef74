"""The gateway and the kvstore start as real processes without loading torch (``-X importtime``
lists every module they import), nor OpenTelemetry's SDK when tracing is off, and warn about
a misspelled ``PDSERVE_*`` variable."""

from __future__ import annotations

import signal
import sys

import pytest

from tests.helpers.import_trace import LIGHT_SERVICES, imported_modules

HEAVY = ("torch", "transformers", "triton")


@pytest.mark.parametrize(("service", "args", "expect"), LIGHT_SERVICES)
def test_service_starts_and_serves_without_torch(
    launcher, tiny_chat_llama_path, service, args, expect
):
    argv = [sys.executable, "-X", "importtime", "-m", f"pdserve.{service}", "--port", "0", *args]
    if service == "gateway":
        argv += ["--model", str(tiny_chat_llama_path)]
    env = {"PDSERVE_CAPACITY_BYTE": "1MiB"}  # misspelled: PDSERVE_CAPACITY_BYTES
    child = launcher.start_ready(service, argv, expect, timeout=60, env=env)
    child.signal(signal.SIGTERM)
    assert child.proc.wait(30) == 0
    log = child.log_text()
    modules = imported_modules(log)
    assert "grpc" in modules and len(modules) > 200  # the check sees the real imports
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert heavy == [], f"{service} imported {heavy[:5]}"
    # Tracing is off: OpenTelemetry's SDK and exporter are not loaded (FastAPI loads the
    # API when it is installed).
    assert not [m for m in modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exp"))]
    assert "PDSERVE_CAPACITY_BYTE is not a pdserve setting" in log
    assert "did you mean PDSERVE_CAPACITY_BYTES?" in log
