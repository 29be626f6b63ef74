"""Where `pdserve up` leaves word of the cluster it runs, so that `pdserve status` (and
anyone on this machine) finds it without flags.

One file per running `up`, ``up-<pid>.json``, in ``$XDG_RUNTIME_DIR/pdserve`` (else
``$PDSERVE_HOME/run``), readable by its owner only (a Redis URL may hold a password); `up`
removes it when it stops, and a file whose process is gone counts for nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.core.model import pdserve_home


@dataclass(frozen=True)
class ClusterState:
    """What `pdserve up` tells of its cluster."""

    pid: int
    redis_url: str
    redis_prefix: str
    gateway: str  # gRPC HOST:PORT
    rest: str  # http://HOST:PORT/v1, "" without REST
    log_dir: str
    started_at: float


def state_dir() -> Path:
    """The directory of the state files."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "pdserve" if runtime else pdserve_home() / "run"


def write_state(state: ClusterState) -> Path:
    """Write ``state`` (owner-only) and return its path."""
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"up-{state.pid}.json"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(asdict(state), out)
    tmp.replace(path)
    return path


def remove_state(pid: int) -> None:
    """Remove the state file of `up` process ``pid``, if any."""
    with contextlib.suppress(FileNotFoundError):
        (state_dir() / f"up-{pid}.json").unlink()


def running_clusters() -> list[ClusterState]:
    """The clusters whose `up` still runs, newest first (files of gone ones are removed)."""
    found = []
    for path in state_dir().glob("up-*.json"):
        try:
            state = ClusterState(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if _alive(state.pid):
            found.append(state)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return sorted(found, key=lambda s: s.started_at, reverse=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, though not ours
        return True
    return True


def new_state(
    redis_url: str, redis_prefix: str, gateway: str, rest: str, log_dir: Path
) -> ClusterState:
    """The state of the cluster this process (`up`) runs."""
    return ClusterState(
        os.getpid(), redis_url, redis_prefix, gateway, rest, str(log_dir), time.time()
    )
