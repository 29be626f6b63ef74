"""Child processes, started and stopped one way: `pdserve up`, the tests' clusters and the
benchmark scripts all use ``Launcher``.

A pdserve service prints ``READY <name> HOST:PORT`` on stdout once it serves (the gateway
prints a second line, ``READY gateway-http HOST:PORT``); a process that prints no such
line (Redis, another vendor's server) is ready when a probe says so. Each child gets its
own process group, so stopping it also stops what it started (and a terminal's Ctrl-C
reaches only the launcher); `pdserve up`'s children also get SIGTERM when it dies. Its
stdout and stderr go to ``<log_dir>/<name>.log``, read by a thread that also takes the
READY lines, so no pipe ever fills. Every PID it starts, it ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PROBE_EVERY_S = 0.05


class StartFailed(RuntimeError):
    """A child exited, or was not ready in time; the message ends with its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for servers that cannot bind port 0 themselves)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


@dataclass
class Child:
    """A started process: its command, log, the READY lines it owes and the addresses in them."""

    name: str
    argv: list[str]
    log_path: Path
    expect: tuple[str, ...]
    probe: Callable[[], bool] | None
    cpus: frozenset[int] | None
    env: dict[str, str]
    proc: subprocess.Popen = field(repr=False, default=None)
    started_at: float = field(default_factory=time.monotonic)
    addresses: dict[str, str] = field(default_factory=dict)
    ready_after_s: float | None = None
    _lines: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _eof: bool = False
    _run: int = 0  # which start of the command the current process is (restarts count)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        """The address of its first READY line."""
        return self.addresses[self.expect[0]]

    @property
    def ready(self) -> bool:
        """Whether ``Launcher.wait_ready`` saw its READY lines and its probe succeed."""
        return self.ready_after_s is not None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_text(self) -> str:
        """How the process ended, e.g. ``exited with code 2`` or ``was killed by SIGKILL``."""
        code = self.proc.returncode
        if code is None:
            return "closed its stdout"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process (not its group)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def _read(self, stdout: Iterable[bytes], run: int) -> None:
        """The reader thread of the ``run``-th start: every stdout line to the log; READY
        lines to ``addresses``. A reader that outlives its process's restart (its end of
        the pipe closes late on a busy machine) speaks no more for the child."""
        with open(self.log_path, "ab") as log:
            for raw in stdout:
                log.write(raw)
                log.flush()
                words = raw.decode(errors="replace").split()
                if len(words) == 3 and words[0] == "READY" and words[1] in self.expect:
                    with self._lines:
                        if run == self._run:
                            self.addresses[words[1]] = words[2]
                        self._lines.notify_all()
        with self._lines:
            if run == self._run:
                self._eof = True
            self._lines.notify_all()


def child_setup(cpus: Iterable[int] | None = None) -> Callable[[], None]:
    """The ``preexec_fn`` of ``die_with_launcher``: a process group of its own (a terminal's
    Ctrl-C reaches only the launcher, which stops children in order), SIGTERM when the
    launcher dies, and ``cpus``.

    The kernel sends that SIGTERM when the *thread* that started the child exits, so only
    children started from the main thread get it (a pool thread may end at any time)."""
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()
    cpus = set(cpus) if cpus else None
    die_with_parent = threading.current_thread() is threading.main_thread()

    def setup() -> None:
        os.setpgid(0, 0)
        if die_with_parent:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the launcher died before prctl
                os.kill(os.getpid(), signal.SIGTERM)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


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


class Launcher:
    """Starts children, waits for them to be ready, restarts and stops them."""

    def __init__(
        self,
        log_dir: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        die_with_launcher: bool = False,
    ) -> None:
        """``die_with_launcher``: children get SIGTERM when this process dies (`pdserve up`).
        It needs a ``preexec_fn``, so a fork that runs the parent's fork handlers: leave it off
        in a process that has loaded gRPC (its fork handler aborts the child), e.g. tests."""
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        self.cwd = cwd
        self.die_with_launcher = die_with_launcher
        self.children: list[Child] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        expect: Sequence[str] = (),
        *,
        probe: Callable[[], bool] | None = None,
        cpus: Iterable[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> Child:
        """Run ``argv``; it is ready once it printed ``READY <e> ADDRESS`` for each ``e`` in
        ``expect`` and ``probe()`` (if any) returned True. Does not wait (see wait_ready)."""
        child = Child(
            name=name,
            argv=list(argv),
            log_path=self.log_dir / f"{name}.log",
            expect=tuple(expect),
            probe=probe,
            cpus=frozenset(cpus) if cpus else None,
            env={**self.env, **(env or {})},
        )
        self._spawn(child)
        self.children.append(child)
        return child

    def _spawn(self, child: Child) -> None:
        with open(child.log_path, "ab") as log:
            log.write(f"$ {' '.join(child.argv)}\n".encode())
            log.flush()
            if self.die_with_launcher:
                spawn = {"preexec_fn": child_setup(child.cpus)}
            else:  # vfork and exec: no fork handlers run, no Python code in the child
                spawn = {"process_group": 0}
            child.proc = subprocess.Popen(
                child.argv,
                cwd=self.cwd,
                env=child.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                **spawn,
            )
        if child.cpus and not self.die_with_launcher:
            # Before the child's runtime starts its threads, which inherit the mask.
            os.sched_setaffinity(child.proc.pid, child.cpus)
        threading.Thread(
            target=child._read,
            args=(child.proc.stdout, child._run),
            name=f"{child.name}-stdout",
            daemon=True,
        ).start()

    def restart(self, child: Child) -> Child:
        """Stop ``child`` if it still runs, then start its command again (same name, log, CPUs)."""
        self.stop([child])
        with child._lines:
            child._run += 1
            child.addresses.clear()
            child._eof = False
        child.ready_after_s = None
        child.started_at = time.monotonic()
        self._spawn(child)
        return child

    def wait_ready(
        self,
        children: Sequence[Child],
        timeout: float,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        """Return once every child is ready. StartFailed names one that exited first or was not
        ready after ``timeout`` s, with its log's tail; ``on_tick()`` runs about every 0.5 s
        (progress, or raising to abort)."""
        deadline = time.monotonic() + timeout
        next_tick = time.monotonic()
        while True:
            for child in children:
                self._poll(child)
            if all(c.ready for c in children):
                return
            if on_tick is not None and time.monotonic() >= next_tick:
                on_tick()
                next_tick = time.monotonic() + 0.5
            if time.monotonic() > deadline:
                waiting = [c for c in children if not c.ready]
                raise StartFailed(
                    f"{', '.join(c.name for c in waiting)} not ready within {timeout:.0f} s\n"
                    + _tail(waiting[0])
                )
            pending = next(c for c in children if not c.ready)
            with pending._lines:
                pending._lines.wait(_PROBE_EVERY_S)

    def poll_ready(self, child: Child) -> bool:
        """Whether ``child`` is ready, after one look (no wait); StartFailed when it exited
        before it was ready."""
        self._poll(child)
        return child.ready

    def _poll(self, child: Child) -> None:
        if child.ready:
            return
        lines_done = all(name in child.addresses for name in child.expect)
        if lines_done and (child.probe is None or child.probe()):
            child.ready_after_s = time.monotonic() - child.started_at
            return
        if child.proc.poll() is not None or (child._eof and not lines_done):
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(5)
            raise StartFailed(
                f"{child.name} {child.exit_text()} before it was ready\n{_tail(child)}"
            )

    def start_ready(
        self,
        name: str,
        argv: Sequence[str],
        expect: Sequence[str] = (),
        timeout: float = 120.0,
        **kwargs,
    ) -> Child:
        """``start`` and ``wait_ready`` in one; a child that fails to start is stopped."""
        child = self.start(name, argv, expect, **kwargs)
        try:
            self.wait_ready([child], timeout)
        except BaseException:
            self.stop([child])
            raise
        return child

    def stop(
        self, children: Sequence[Child], timeout: float = 15.0, sig: int = signal.SIGTERM
    ) -> None:
        """Send ``sig`` to the children's process groups together and wait up to ``timeout`` s;
        SIGKILL the groups of those still there."""
        deadline = time.monotonic() + timeout
        alive = [c for c in children if c.alive()]
        for child in alive:
            _signal_group(child, sig)
        for child in alive:
            try:
                child.proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                _signal_group(child, signal.SIGKILL)
                child.proc.wait(5)

    def stop_all(self, timeout: float = 15.0) -> None:
        """Stop every child, the last started first."""
        for child in reversed(self.children):
            self.stop([child], timeout)


def _signal_group(child: Child, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, sig)  # pgid == pid: child_setup made it a group leader


def _tail(child: Child) -> str:
    return f"--- last lines of {child.log_path} ---\n{child.log_tail(30)}\n---"
