"""Child processes of a launcher (`pdserve up`): start, wait for ``READY`` lines, stop by PID.

A service prints ``READY <name> HOST:PORT`` on stdout once it serves (the gateway prints a
second line, ``READY gateway-http HOST:PORT``). Its stderr goes to a log file; what it
prints on stdout after its READY lines is appended there too, so the pipe never fills.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


@dataclass
class Child:
    """A started service: its process, log, the READY lines it owes and those it printed."""

    name: str
    process: subprocess.Popen
    log_path: Path
    expect: tuple[str, ...]
    started_at: float = field(default_factory=time.monotonic)
    addresses: dict[str, str] = field(default_factory=dict)
    ready_after_s: float | None = None
    _buffer: bytes = b""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def ready(self) -> bool:
        return all(name in self.addresses for name in self.expect)

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_text(self) -> str:
        """How the process ended, e.g. ``exited with code 2`` or ``was killed by SIGKILL``."""
        code = self.process.returncode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def read_stdout(self) -> bool:
        """Take what stdout has (call when it is readable); False at end of file."""
        chunk = os.read(self.process.stdout.fileno(), 65536)
        if not chunk:
            return False
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            self._take_line(raw.decode(errors="replace").strip())
        return True

    def _take_line(self, line: str) -> None:
        words = line.split()
        if len(words) == 3 and words[0] == "READY" and words[1] in self.expect:
            self.addresses[words[1]] = words[2]
            if self.ready and self.ready_after_s is None:
                self.ready_after_s = time.monotonic() - self.started_at
            return
        if line:
            with open(self.log_path, "a") as log:
                log.write(f"[stdout] {line}\n")


def read_ready_line(process: subprocess.Popen, name: str, timeout: float) -> str:
    """The address from ``process``'s ``READY <name> <address>`` line on stdout."""
    child = Child(name, process, Path(os.devnull), (name,))
    poll_ready([child], timeout)
    return child.addresses[name]


def poll_ready(children: Sequence[Child], timeout: float, on_tick: Callable | None = None) -> None:
    """Read stdout of ``children`` until each printed its READY lines.

    Raises RuntimeError naming a child that exited first, TimeoutError after ``timeout``.
    ``on_tick()`` runs about twice a second (progress, or raising to abort)."""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for child in children:
            selector.register(child.process.stdout, selectors.EVENT_READ, child)
        while not all(c.ready for c in children):
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = ", ".join(c.name for c in children if not c.ready)
                raise TimeoutError(f"{waiting} not ready within {timeout:.0f} s")
            for key, _ in selector.select(min(left, 0.5)):
                child = key.data
                if not child.read_stdout():
                    selector.unregister(key.fileobj)
                    if not child.ready:
                        raise RuntimeError(f"{child.name} {_exit_text(child)} before it was ready")
            if on_tick is not None:
                on_tick()


def _exit_text(child: Child) -> str:
    try:
        child.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return "closed its stdout"
    return child.exit_text()


def cpu_slices(cpus: Sequence[int], n: int) -> list[list[int]]:
    """``n`` contiguous, near-equal slices of ``cpus``; one core each, round-robin, when
    there are more processes than cores."""
    if n <= 0:
        return []
    if n > len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(n)]
    base, extra = divmod(len(cpus), n)
    out, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(list(cpus[start : start + size]))
        start += size
    return out


def child_setup(cpus: Iterable[int] | None = None) -> Callable[[], None]:
    """A ``preexec_fn``: a process group of its own (a terminal's Ctrl-C reaches only the
    launcher, which stops services in order), SIGTERM when the launcher dies, and ``cpus``."""
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()
    cpus = set(cpus) if cpus is not None else None

    def setup() -> None:
        os.setpgid(0, 0)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the launcher died before prctl
            os.kill(os.getpid(), signal.SIGTERM)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


class Supervisor:
    """Starts children and stops them in stages; every PID it started, it ends."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = env if env is not None else dict(os.environ)
        self.children: list[Child] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        expect: Sequence[str],
        cpus: Iterable[int] | None = None,
    ) -> Child:
        """Run ``argv`` with stdout piped (for READY lines) and stderr to ``<name>.log``."""
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                preexec_fn=child_setup(cpus),
            )
        child = Child(name, process, log_path, tuple(expect))
        self.children.append(child)
        return child

    def dead(self) -> Child | None:
        """A child that exited, if any."""
        return next((c for c in self.children if not c.alive()), None)

    def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` for output, appending it to the logs (keeps pipes empty)."""
        with selectors.DefaultSelector() as selector:
            for child in self.children:
                if child.process.stdout is not None and not child.process.stdout.closed:
                    selector.register(child.process.stdout, selectors.EVENT_READ, child)
            if not selector.get_map():
                time.sleep(timeout)
                return
            for key, _ in selector.select(timeout):
                if not key.data.read_stdout():
                    key.fileobj.close()

    def stop(self, children: Sequence[Child], deadline: float) -> None:
        """SIGTERM ``children`` together and wait for them until ``deadline`` (monotonic);
        SIGKILL those still there then."""
        alive = [c for c in children if c.alive()]
        for child in alive:
            child.process.terminate()
        for child in alive:
            try:
                child.process.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait(5)
        for child in children:
            if child.process.stdout is not None:
                child.process.stdout.close()
