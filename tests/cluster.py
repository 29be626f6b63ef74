"""Start pdserve services as real processes on 127.0.0.1 for tests, and stop them."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_READY = re.compile(r"^READY ([\w-]+) (\S+)$")


@dataclass
class Service:
    """A started service: its process, address and captured log file."""

    name: str
    proc: subprocess.Popen
    address: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Cluster:
    """Processes started by a test, stopped (by PID) at the end."""

    log_dir: Path
    services: list[Service] = field(default_factory=list)

    def start(self, name: str, module: str, *args: str, timeout: float = 120.0) -> Service:
        """Run ``python -m module --port 0 args...`` and wait for its READY line."""
        log = self.log_dir / f"{name}.log"
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"),
            # A gateway's REST API on any free port, so that several gateways can run.
            "PDSERVE_HTTP_PORT": os.environ.get("PDSERVE_HTTP_PORT", "0"),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--port", "0", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),  # noqa: SIM115 (closed with the process)
            text=True,
            env=env,
        )
        address = self._wait_ready(proc, name, log, timeout)
        svc = Service(name, proc, address, log)
        self.services.append(svc)
        return svc

    def _wait_ready(self, proc: subprocess.Popen, name: str, log: Path, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                )
            if sel.select(timeout=0.5):
                line = proc.stdout.readline().strip()
                m = _READY.match(line)
                if m:
                    return m.group(2)
        proc.kill()
        raise TimeoutError(f"{name} not ready after {timeout:.0f}s:\n{log.read_text()[-3000:]}")

    def address(self, name: str) -> str:
        """The address of the started service called ``name``."""
        return next(s.address for s in self.services if s.name == name)

    def stop(self, svc: Service, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if svc.proc.poll() is None:
            svc.proc.send_signal(sig)
            try:
                svc.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                svc.proc.kill()
                svc.proc.wait(timeout=5)
        return svc.proc.returncode

    def stop_all(self) -> None:
        for svc in reversed(self.services):
            self.stop(svc)

    def unhandled_errors(self) -> list[str]:
        """Log lines of every service that show an unhandled exception."""
        bad = []
        for svc in self.services:
            for line in svc.log_text().splitlines():
                if "Traceback" in line or "Exception in callback" in line or "Unhandled" in line:
                    bad.append(f"{svc.name}: {line}")
        return bad


def http_ready_line(gateway: Service) -> str:
    """The REST address from a gateway's second READY line (``start`` reads only the first).

    The gateway prints it right after the first; if it died instead, readline gets EOF.
    (No select() here: the line may already sit in the pipe reader's buffer.)"""
    line = gateway.proc.stdout.readline().strip()
    match = re.fullmatch(r"READY gateway-http (\S+)", line)
    if not match:
        raise RuntimeError(f"expected the gateway's HTTP READY line, got {line!r}")
    return match.group(1)
