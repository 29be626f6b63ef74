"""`pdserve up`'s supervisor against trivial child processes: restarts after backoff, a
healthy run resetting the count, giving up on a crash loop."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from pdserve.local.launcher import Launcher
from pdserve.local.supervisor import GaveUp, RestartPolicy, Supervisor

SERVE = "import time; print('READY svc 127.0.0.1:5', flush=True); time.sleep(60)"
FAST = RestartPolicy(first_delay_s=0.2, max_delay_s=0.4, healthy_after_s=60.0, max_crashes=5)


@pytest.fixture
def launcher(tmp_path):
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.stop_all(timeout=5)


def py(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def tick_until(supervisor: Supervisor, predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        supervisor.tick()
        time.sleep(0.02)


def kill(child) -> int:
    pid = child.pid
    child.signal(signal.SIGKILL)
    child.proc.wait(5)
    return pid


def test_backoff_doubles_from_one_second_up_to_thirty():
    policy = RestartPolicy()
    assert [policy.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert policy.max_crashes == 5 and policy.healthy_after_s == 60


def test_the_help_names_only_the_waits_a_child_reaches():
    """The 5th crash in a row stops the cluster: the 16 and 30 s waits never come."""
    text = RestartPolicy().describe()
    assert "restarted after 1, 2, 4 and 8 s" in text
    assert "5 crashes in a row stop the cluster" in text


def test_a_child_that_dies_is_restarted_after_its_backoff(launcher):
    child = launcher.start_ready("svc", py(SERVE), ["svc"], timeout=30)
    exits = []
    supervisor = Supervisor(launcher, [child], 30, FAST, on_exit=lambda c, pid: exits.append(pid))
    supervisor.tick()
    first = kill(child)
    supervisor.tick()
    assert exits == [first] and not child.alive()  # noted, the restart waits for its delay
    tick_until(supervisor, lambda: child.alive() and child.ready)
    assert child.pid != first and child.address == "127.0.0.1:5"
    assert "killed by SIGKILL" not in child.exit_text()  # the new run


def test_a_crash_loop_gives_up_naming_the_child_and_its_log(launcher):
    code = "import sys; print('READY svc 127.0.0.1:5', flush=True); print('boom', file=sys.stderr)"
    child = launcher.start("svc", py(code + "; import time; time.sleep(0.3); sys.exit(4)"), ["svc"])
    launcher.wait_ready([child], 30)
    policy = RestartPolicy(first_delay_s=0.05, max_delay_s=0.1, max_crashes=3)
    supervisor = Supervisor(launcher, [child], 30, policy)
    with pytest.raises(GaveUp, match="svc exited with code 4") as info:
        tick_until(supervisor, lambda: False)
    assert "3 crashes in a row" in str(info.value) and "boom" in str(info.value)


def test_a_healthy_run_starts_the_count_over(launcher):
    child = launcher.start_ready("svc", py(SERVE), ["svc"], timeout=30)
    policy = RestartPolicy(first_delay_s=0.05, max_delay_s=0.1, healthy_after_s=0.5, max_crashes=2)
    supervisor = Supervisor(launcher, [child], 30, policy)
    for _ in range(3):  # three crashes, each after a healthy run: never two in a row
        pid = kill(child)
        tick_until(supervisor, lambda: child.ready and child.pid != pid)  # noqa: B023
        ready = time.monotonic()
        tick_until(supervisor, lambda: time.monotonic() - ready > 1.0)  # noqa: B023
    assert child.alive()


def test_a_restart_that_is_not_ready_in_time_counts_as_a_crash(launcher, tmp_path):
    # The first run is ready; every later one never prints its READY line.
    code = (
        "import os, sys, time; p = sys.argv[1]; first = not os.path.exists(p); "
        "open(p, 'a').close(); first and print('READY svc 127.0.0.1:5', flush=True); "
        "time.sleep(60)"
    )
    child = launcher.start_ready("svc", py(code, str(tmp_path / "ran")), ["svc"], timeout=30)
    policy = RestartPolicy(first_delay_s=0.05, max_delay_s=0.1, max_crashes=2)
    supervisor = Supervisor(launcher, [child], 1.0, policy)
    kill(child)
    with pytest.raises(GaveUp, match="svc was not ready within 1 s"):
        tick_until(supervisor, lambda: False)
    assert not child.alive()  # stopped, not left running
