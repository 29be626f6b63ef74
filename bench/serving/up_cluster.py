"""`pdserve up` as a benchmark's cluster: started with the flags given, used once its
summary says it is up, stopped with Ctrl-C (SIGINT) when the block ends."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

UP_LINE = "Ctrl-C stops everything"


@contextlib.contextmanager
def pdserve_up(flags: Sequence[str], name: str, timeout_s: float = 900.0) -> Iterator[None]:
    """Run `pdserve up FLAGS` for the block; RuntimeError naming ``name`` if it is not up
    within ``timeout_s`` or exits first."""
    argv = [sys.executable, "-m", "pdserve.cli", "up", *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:
            if UP_LINE in line:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: pdserve up did not start")
        else:
            raise RuntimeError(f"{name}: pdserve up exited {proc.wait()}")
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
