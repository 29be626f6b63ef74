"""`pdserve up` as a child process of a test: started in its own session, its stdout read
line by line to a marker, its descendants found and checked gone."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def start_up(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,  # no reader buffer: select() must see every line still unread
        start_new_session=True,
    )


def read_until(proc: subprocess.Popen, marker: str, timeout: float) -> str:
    """stdout up to and including the line that starts with ``marker``."""
    out = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(max(deadline - time.monotonic(), 0.01)):
                continue
            line = proc.stdout.readline().decode()
            if not line:
                break
            out.append(line)
            if line.startswith(marker):
                return "".join(out)
    proc.kill()
    raise AssertionError(f"no {marker!r} line; stdout:\n{''.join(out)}\n{stderr_of(proc)}")


def stderr_of(proc: subprocess.Popen) -> str:
    return proc.stderr.read().decode(errors="replace")


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = {int(p) for p in task.read_text().split()}
            except OSError:
                continue
            todo += kids - found
            found |= kids
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def status(*args: str, env: dict[str, str] | None = None) -> dict:
    """`pdserve status --json` with ``args`` (none: it finds the cluster `up` started, by
    ``env``'s XDG_RUNTIME_DIR), parsed."""
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--json", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
