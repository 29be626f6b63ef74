"""The one launcher, against trivial child processes: READY lines, logs, early exits, probes,
restart, and stops that take the whole process group."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from pdserve.local.launcher import Launcher, StartFailed


@pytest.fixture
def launcher(tmp_path):
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.stop_all(timeout=5)


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


SERVE = "import time; print('hello'); print('READY svc 127.0.0.1:5', flush=True); time.sleep(60)"


def test_ready_lines_give_addresses_and_other_output_goes_to_the_log(launcher):
    child = launcher.start_ready("svc", py(SERVE), ["svc"], timeout=30)
    assert child.address == "127.0.0.1:5" and child.ready_after_s is not None
    assert "hello" in child.log_text()
    assert child.log_text().startswith("$ ")  # the command line, first


def test_a_child_that_exits_first_is_named_with_its_code_and_log(launcher):
    argv = py("import sys; print('bad flag', file=sys.stderr); raise SystemExit(3)")
    with pytest.raises(StartFailed, match="svc exited with code 3 before it was ready") as info:
        launcher.start_ready("svc", argv, ["svc"], timeout=30)
    assert "bad flag" in str(info.value)


def test_a_child_not_ready_in_time_is_stopped(launcher):
    with pytest.raises(StartFailed, match="svc not ready within 1 s"):
        launcher.start_ready("svc", py("import time; time.sleep(60)"), ["svc"], timeout=1)
    assert not launcher.children[0].alive()


def test_a_probe_decides_readiness_without_ready_lines(launcher, tmp_path):
    flag = tmp_path / "up"
    child = launcher.start("probe", py("import time; time.sleep(60)"), probe=flag.exists)
    time.sleep(0.3)
    assert not child.ready
    flag.touch()
    launcher.wait_ready([child], timeout=10)
    assert child.ready


def test_restart_runs_the_command_again(launcher):
    child = launcher.start_ready("svc", py(SERVE), ["svc"], timeout=30)
    first = child.pid
    child.signal(signal.SIGKILL)
    child.proc.wait(5)
    assert "killed by SIGKILL" in child.exit_text()
    launcher.restart(child)
    launcher.wait_ready([child], timeout=30)
    assert child.alive() and child.pid != first and child.address == "127.0.0.1:5"


def test_a_restart_is_not_failed_by_the_old_process_closing_its_stdout_late(launcher):
    """The killed process's end of the pipe closes after the restart (here a process of its
    own session keeps it open 1 s more; on a busy machine the reader thread may be late):
    that end of file is the old run's, not the new one's."""
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3)'], "
        "start_new_session=True); "
        "time.sleep(2); print('READY svc 127.0.0.1:5', flush=True); time.sleep(60)"
    )
    child = launcher.start_ready("svc", py(code), ["svc"], timeout=30)
    launcher.stop([child], sig=signal.SIGKILL)
    launcher.restart(child)
    launcher.wait_ready([child], timeout=30)
    assert child.alive() and child.address == "127.0.0.1:5"


def test_stop_ends_the_process_group_and_kills_what_ignores_sigterm(launcher):
    # The child ignores SIGTERM and starts a grandchild: both must be gone after stop().
    code = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('READY svc', p.pid, flush=True); time.sleep(60)"
    )
    child = launcher.start_ready("svc", py(code), ["svc"], timeout=30)
    grandchild = int(child.address)
    began = time.monotonic()
    launcher.stop([child], timeout=1)
    assert time.monotonic() - began < 5
    assert child.proc.returncode == -signal.SIGKILL
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the grandchild outlived stop()")


def test_cpus_pin_the_child(launcher):
    cpu = sorted(os.sched_getaffinity(0))[0]
    code = (
        "import os, time; time.sleep(0.5); print('READY svc', min(os.sched_getaffinity(0)), "
        "flush=True); time.sleep(60)"
    )
    child = launcher.start_ready("svc", py(code), ["svc"], timeout=30, cpus=[cpu])
    assert child.address == str(cpu)
