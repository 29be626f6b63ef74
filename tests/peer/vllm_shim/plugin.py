"""The pytest plugin of the vLLM peer run (``-p pdserve_peer_shim.plugin``): installs the
vllm stub before any test module is imported, makes its placeholders strict once collection
is over, and records every test's outcome into the JSON file PEER_VLLM_RESULTS names."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from . import vllm_stub

vllm_stub.install()


def _on_sigterm(signum, frame) -> None:
    """Stop the pdserve servers this run started before pytest goes."""
    from .server import RemoteOpenAIServer

    RemoteOpenAIServer.shutdown_all()
    sys.exit(128 + signum)


signal.signal(signal.SIGTERM, _on_sigterm)

_RESULTS: dict[str, dict] = {}
_ORDER = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 2, "failed": 3, "error": 4}


def _message(report) -> str:
    """The error line of a failure (its ``E`` lines), or the skip reason."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = report.longreprtext or ""
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    if lines:
        return " | ".join(lines[:6])[:600]
    return (text.strip().splitlines() or [""])[-1][:600]


def _hint(text: str) -> str:
    if "VllmInternalError" in text or "vllm stub" in text:
        return "vllm-internal"
    if "Failed: Timeout" in text or "+++++ Timeout" in text:
        return "timeout"
    if "StartFailed" in text or "Server exited unexpectedly" in text:
        return "server-start"
    return ""


def _record(nodeid: str, outcome: str, phase: str, report, duration: float) -> None:
    entry = _RESULTS.setdefault(nodeid, {"outcome": "passed", "duration": 0.0})
    entry["duration"] = round(entry["duration"] + duration, 3)
    if _ORDER[outcome] < _ORDER.get(entry["outcome"], 0):
        return
    if outcome == "passed" and phase != "call":
        return
    entry["outcome"] = outcome
    if outcome != "passed":
        text = report.longreprtext or ""
        entry["phase"] = phase
        entry["message"] = _message(report)
        entry["hint"] = _hint(text)
        entry["longrepr"] = text[-6000:]


def pytest_collection_finish(session) -> None:
    vllm_stub.set_strict(True)


def pytest_collectreport(report) -> None:
    if report.failed:
        _record(report.nodeid, "error", "collect", report, 0.0)
    elif report.skipped:
        _record(report.nodeid, "skipped", "collect", report, 0.0)


def pytest_runtest_logreport(report) -> None:
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
    elif report.failed:
        outcome = "error"
    elif report.skipped:
        outcome = "skipped"
    else:
        outcome = "passed"
    _record(report.nodeid, outcome, report.when, report, report.duration)
    if report.when == "teardown":
        _write(finished=False)


def _write(finished: bool) -> None:
    """The results so far (after each test, so a long run can be read while it goes)."""
    path = os.environ.get("PEER_VLLM_RESULTS")
    if path:
        partial = path + ".part"
        with open(partial, "w") as f:
            json.dump({"finished": time.time() if finished else None, "tests": _RESULTS}, f)
        os.replace(partial, path)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    from .server import RemoteOpenAIServer

    RemoteOpenAIServer.shutdown_all()
    _write(finished=True)
