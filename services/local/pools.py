"""The worker pools of `pdserve up --autoscale`: the planner sets each pool's size
(``scale``, from its thread), and `up`'s main loop starts and stops workers to match
(``reconcile``). A new worker takes the least-used cores (``cores_per_worker`` of them) and
is watched by the supervisor like the others; a removed one, the newest of its pool, is
first unwatched, then sent SIGTERM: it deregisters (gateways stop routing to it at once),
lets its running requests finish for its drain timeout, hands over the streams still
running, and exits."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence

from pdserve.local.launcher import Child, Launcher
from pdserve.local.supervisor import Supervisor


class LocalPools:
    """Worker processes per pool ("prefill", "decode")."""

    def __init__(
        self,
        launcher: Launcher,
        start_worker: Callable[[str, str, list[int]], Child],
        cpus: Sequence[int],
        cores_per_worker: int,
        stop_timeout_s: float,
    ) -> None:
        """``start_worker(role, name, cpus)`` launches one worker (not waiting for it)."""
        self.launcher = launcher
        self.start_worker = start_worker
        self.cpus = list(cpus)
        self.cores_per_worker = max(min(cores_per_worker, len(self.cpus)), 1)
        self.stop_timeout_s = stop_timeout_s
        self.supervisor: Supervisor | None = None
        self._lock = threading.Lock()
        self._desired: dict[str, int] = {}
        self._workers: dict[str, list[Child]] = {"prefill": [], "decode": []}
        self._cores: dict[str, list[int]] = {}  # child name -> its cores
        self._next = Counter()
        self.stopping: list[threading.Thread] = []

    def take_cores(self) -> list[int]:
        """The ``cores_per_worker`` least-used cores (the last cores first on a tie)."""
        used = Counter(c for cores in self._cores.values() for c in cores)
        order = sorted(reversed(self.cpus), key=lambda c: used[c])
        return sorted(order[: self.cores_per_worker])

    def add(self, role: str) -> Child:
        """Start one more ``role`` worker."""
        cpus = self.take_cores()
        name = f"{role}-{self._next[role]}"
        self._next[role] += 1
        child = self.start_worker(role, name, cpus)
        self._cores[name] = cpus
        self._workers[role].append(child)
        if self.supervisor is not None:
            self.supervisor.watch(child)
        return child

    def remove(self, role: str) -> Child:
        """Drain and stop the newest ``role`` worker, in the background."""
        child = self._workers[role].pop()
        self._cores.pop(child.name, None)
        if self.supervisor is not None:
            self.supervisor.unwatch(child)
        thread = threading.Thread(
            target=self.launcher.stop,
            args=([child], self.stop_timeout_s),
            name=f"stop-{child.name}",
            daemon=True,
        )
        thread.start()
        self.stopping = [t for t in self.stopping if t.is_alive()] + [thread]
        print(f"pdserve up: draining {child.name} (pid {child.pid})", flush=True)
        return child

    def workers(self, role: str) -> list[Child]:
        return list(self._workers[role])

    # --- the planner's side (its own thread) --------------------------------------------

    def replicas(self, pool: str) -> int:
        with self._lock:
            return self._desired.get(pool, len(self._workers[pool]))

    def scale(self, pool: str, replicas: int) -> None:
        with self._lock:
            self._desired[pool] = replicas

    # --- up's main loop -----------------------------------------------------------------

    def reconcile(self) -> None:
        """Start or stop workers until each pool has the size last asked."""
        with self._lock:
            desired = dict(self._desired)
        for role, size in desired.items():
            while len(self._workers[role]) < size:
                child = self.add(role)
                print(f"pdserve up: scaling {role} up: started {child.name}", flush=True)
            while len(self._workers[role]) > size:
                self.remove(role)
