"""Start a kvstore as a separate process and wait for its READY line (tests, benchmarks)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from services.supervisor import read_ready_line

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
