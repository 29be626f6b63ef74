"""Keeps `pdserve up`'s children running: a child that exits is started again, with backoff.

The n-th crash in a row of one child waits ``min(1 s * 2**(n-1), 30 s)`` before the restart;
a child that has been ready for a minute starts its count over. A child that crashes 5 times
in a row (none of its runs lasting that minute; failing to become ready within the startup
timeout counts as a crash) is failing for a reason a restart will not fix: the supervisor
then gives up, and `pdserve up` stops everything. So a child is restarted after 1, 2, 4 and
8 s, and its 5th crash in a row stops the cluster (``RestartPolicy.describe``); the 30 s cap
is for policies that allow more crashes. The other children go on serving meanwhile; a
restarted worker rejoins through the registry.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.local.launcher import Child, Launcher, StartFailed


@dataclass(frozen=True)
class RestartPolicy:
    """How restarts back off, and when they stop."""

    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    healthy_after_s: float = 60.0  # ready this long: the crash count starts over
    max_crashes: int = 5  # in a row: then give up

    def delay(self, crashes: int) -> float:
        """Seconds before the restart that follows the ``crashes``-th crash in a row."""
        return min(self.first_delay_s * 2 ** (crashes - 1), self.max_delay_s)

    def describe(self) -> str:
        """What happens to a child that keeps exiting, in a sentence (for --help)."""
        waits = [f"{self.delay(n):g}" for n in range(1, self.max_crashes)]
        return (
            f"A child that exits is restarted after {', '.join(waits[:-1])} and {waits[-1]} s "
            f"as it keeps crashing (a run ready for {self.healthy_after_s:g} s starts the count "
            f"over); {self.max_crashes} crashes in a row stop the cluster."
        )


class GaveUp(RuntimeError):
    """A child crashed ``max_crashes`` times in a row; the message says which and why."""


@dataclass
class _Watched:
    child: Child
    crashes: int = 0  # in a row
    restart_at: float | None = None  # when the pending restart is due (monotonic)
    starting: bool = False  # restarted, not ready yet
    ready_at: float | None = None  # when its current run became ready


class Supervisor:
    """Restarts the children it watches when they exit; ``tick()`` once in a while."""

    def __init__(
        self,
        launcher: Launcher,
        children: Sequence[Child],
        startup_timeout_s: float,
        policy: RestartPolicy | None = None,
        on_exit: Callable[[Child, int], None] | None = None,
    ) -> None:
        """``on_exit(child, pid)``: called when a child has exited, before its restart
        (`pdserve up` removes the registry entry of that pid)."""
        self.launcher = launcher
        self.startup_timeout_s = startup_timeout_s
        self.policy = policy or RestartPolicy()
        self.on_exit = on_exit
        now = time.monotonic()
        self._watched = [_Watched(c, ready_at=now) for c in children]

    def watch(self, child: Child) -> None:
        """Watch ``child``, just started: it is reported once ready, restarted if it exits."""
        self._watched.append(_Watched(child, starting=True))

    def unwatch(self, child: Child) -> None:
        """Stop watching ``child`` (it is being stopped on purpose)."""
        self._watched = [w for w in self._watched if w.child is not child]

    def tick(self) -> None:
        """Look at every child once: note exits, restart those whose backoff is over, report
        those that are back. GaveUp when one has crashed too often in a row."""
        now = time.monotonic()
        for w in self._watched:
            if w.restart_at is not None:
                if now >= w.restart_at:
                    self._restart(w, now)
            elif w.starting:
                self._check_start(w, now)
            elif not w.child.alive():
                self._crashed(w, now, w.child.exit_text())
            elif w.crashes and now - w.ready_at >= self.policy.healthy_after_s:
                w.crashes = 0

    def _restart(self, w: _Watched, now: float) -> None:
        w.restart_at = None
        w.starting = True
        self.launcher.restart(w.child)
        print(f"pdserve up: restarting {w.child.name} (pid {w.child.pid})", flush=True)

    def _check_start(self, w: _Watched, now: float) -> None:
        try:
            ready = self.launcher.poll_ready(w.child)
        except StartFailed:
            self._crashed(w, now, f"{w.child.exit_text()} before it was ready")
            return
        if ready:
            w.starting = False
            w.ready_at = now
            how = "back" if w.child._run else "ready"
            print(
                f"  ✓ {w.child.name} {how} at {w.child.address} ({w.child.ready_after_s:.1f} s)",
                flush=True,
            )
        elif now - w.child.started_at > self.startup_timeout_s:
            self.launcher.stop([w.child])
            self._crashed(w, now, f"was not ready within {self.startup_timeout_s:.0f} s")

    def _crashed(self, w: _Watched, now: float, how: str) -> None:
        child = w.child
        w.starting = False
        w.crashes += 1
        if self.on_exit is not None:
            self.on_exit(child, child.pid)
        tail = f"--- last lines of {child.log_path} ---\n{child.log_tail(10)}\n---"
        if w.crashes >= self.policy.max_crashes:
            raise GaveUp(
                f"{child.name} {how}: {w.crashes} crashes in a row, none of its runs lasting "
                f"{self.policy.healthy_after_s:.0f} s; giving up and stopping the cluster\n{tail}"
            )
        delay = self.policy.delay(w.crashes)
        w.restart_at = now + delay
        print(
            f"pdserve up: {child.name} {how}; restarting it in {delay:g} s "
            f"(crash {w.crashes} in a row; {self.policy.max_crashes} stop the cluster)\n{tail}",
            file=sys.stderr,
            flush=True,
        )
