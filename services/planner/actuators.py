"""What the planner scales pools through: a pool is "prefill" or "decode", its size a
number of workers. `pdserve up --autoscale` starts and stops local worker processes
(``pdserve.up``'s ``LocalPools``); in Kubernetes the planner patches the scale of the pools'
Deployments (``pdserve.planner.kubernetes``); ``LogActuator`` only says what it would do."""

from __future__ import annotations

import logging
from typing import Protocol

POOLS = ("prefill", "decode")

logger = logging.getLogger(__name__)


class ActuatorError(RuntimeError):
    """A pool's size could not be read or set; the message says which and why."""


class Actuator(Protocol):
    """Reads and sets each pool's replicas."""

    def replicas(self, pool: str) -> int:
        """The replicas ``pool`` is set to now (what was asked, not what is ready)."""
        ...

    def scale(self, pool: str, replicas: int) -> None:
        """Set ``pool`` to ``replicas``; a smaller number drains the workers it removes."""
        ...


class LogActuator:
    """Scales nothing: remembers and logs what it was asked (``--dry-run``)."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self._replicas = dict(replicas)

    def replicas(self, pool: str) -> int:
        return self._replicas[pool]

    def scale(self, pool: str, replicas: int) -> None:
        logger.info("dry run: would scale %s to %d", pool, replicas)
        self._replicas[pool] = replicas
