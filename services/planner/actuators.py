"""What the planner scales pools through: a pool is "prefill" or "decode", its size a
number of workers. `pdserve up --autoscale` starts and stops local worker processes
(``pdserve.local.pools.LocalPools``); in Kubernetes the planner patches the scale of the
pools' Deployments (``pdserve.planner.kubernetes``); a dry run scales nothing (the registry
then says each pool's size: ``pdserve.planner.online.RegistryCounts``)."""

from __future__ import annotations

from typing import Protocol

POOLS = ("prefill", "decode")


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
