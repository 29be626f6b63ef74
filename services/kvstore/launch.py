"""Start a kvstore as a separate process and wait for its READY line (tests, benchmarks)."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class KVStoreProcess:
    """A running kvstore process and the address it printed."""

    process: subprocess.Popen
    address: str

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM (graceful stop), SIGKILL if it is still there after ``timeout``; the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        return self.process.returncode


def read_ready_line(process: subprocess.Popen, name: str, timeout: float) -> str:
    """The address from the process's ``READY <name> <address>`` line on stdout."""
    deadline = time.monotonic() + timeout
    fd = process.stdout.fileno()
    buffer = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while b"\n" not in buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{name} printed no READY line within {timeout:.0f} s")
            if not selector.select(left):
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                code = process.wait()
                raise RuntimeError(f"{name} exited with code {code} before it was ready")
            buffer += chunk
    line = buffer.split(b"\n", 1)[0].decode()
    words = line.split()
    if len(words) != 3 or words[:2] != ["READY", name]:
        raise RuntimeError(f"{name} printed {line!r} instead of 'READY {name} <address>'")
    return words[2]


def start_kvstore(
    capacity_bytes: int | str,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout: float = 30.0,
    stderr: IO | int | None = None,
    env: dict[str, str] | None = None,
) -> KVStoreProcess:
    """``python -m services.kvstore`` on host:port (0: a free port), once it accepts calls."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.kvstore",
            "--host",
            host,
            "--port",
            str(port),
            "--capacity-bytes",
            str(capacity_bytes),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env,
    )
    try:
        address = read_ready_line(process, "kvstore", timeout)
    except BaseException:
        KVStoreProcess(process, "").stop()
        raise
    return KVStoreProcess(process, address)
