"""Test-only fault injection: make a worker's engine thread fail on purpose, so that tests
can watch the watchdog act (health NOT_SERVING, deregistered, exit 3).

``PDSERVE_TEST_FAULT``, read once when the worker starts, takes one of:

    engine-thread-death-after:N   before step N+1, the engine thread raises outside the
                                  step's error handling, and dies
    engine-stall-after:N          step N+1 never returns
    engine-step-delay:SECONDS     every step takes SECONDS longer: slow, not stalled

Never set it outside tests.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from pdserve.core.errors import SettingsError
from pdserve.settings.variables import TEST_FAULT as TEST_FAULT_ENV


class InjectedFault(RuntimeError):
    """The failure ``PDSERVE_TEST_FAULT`` asked for."""


def step_fault(spec: str | None = None) -> Callable[[int], None] | None:
    """The engine's ``before_step`` hook for ``spec`` (default: ``$PDSERVE_TEST_FAULT``);
    None when unset. SettingsError naming the variable for a value it cannot read."""
    spec = os.environ.get(TEST_FAULT_ENV) if spec is None else spec
    if not spec:
        return None
    kind, _, arg = spec.partition(":")
    try:
        if kind == "engine-thread-death-after":
            return _death_after(_count(arg))
        if kind == "engine-stall-after":
            return _stall_after(_count(arg))
        if kind == "engine-step-delay":
            delay_s = float(arg)
            if delay_s < 0:
                raise ValueError
            return lambda _step: time.sleep(delay_s)
    except ValueError:
        pass
    raise SettingsError(
        f"{TEST_FAULT_ENV}={spec!r}: expected engine-thread-death-after:N, "
        "engine-stall-after:N or engine-step-delay:SECONDS (a test-only setting)"
    )


def _count(arg: str) -> int:
    n = int(arg)
    if n < 0:
        raise ValueError
    return n


def _death_after(n: int) -> Callable[[int], None]:
    def before_step(step: int) -> None:
        if step >= n:
            raise InjectedFault(f"{TEST_FAULT_ENV}: engine thread death after {n} steps")

    return before_step


def _stall_after(n: int) -> Callable[[int], None]:
    def before_step(step: int) -> None:
        if step >= n:
            threading.Event().wait()  # forever: a step that never returns

    return before_step
