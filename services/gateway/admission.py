"""How many REST requests generate at once: a bounded number running, a bounded queue waiting.

A request past both bounds, or one that waits longer than the queue's deadline, is refused
(``Overloaded``) rather than left to hang; the REST front answers it with 429 and Retry-After.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Overloaded(RuntimeError):
    """The gateway is running and queueing as many requests as it may; try again later."""


class Admission:
    """At most ``max_running`` holders of a slot; at most ``max_waiting`` waiting for one."""

    def __init__(self, max_running: int, max_waiting: int, wait_timeout_s: float) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.wait_timeout_s = wait_timeout_s
        self.num_running = 0
        self.num_waiting = 0
        self._free = asyncio.Semaphore(max_running)

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if none is free; raises Overloaded."""
        if not self._free.locked():
            await self._free.acquire()  # free: returns at once
        elif self.num_waiting >= self.max_waiting:
            raise Overloaded(
                f"the server is busy: {self.num_running} requests running and "
                f"{self.num_waiting} waiting; retry later"
            )
        else:
            self.num_waiting += 1
            try:
                await asyncio.wait_for(self._free.acquire(), self.wait_timeout_s)
            except TimeoutError:
                raise Overloaded(
                    f"the server is busy: no request slot freed within {self.wait_timeout_s:g}s; "
                    "retry later"
                ) from None
            finally:
                self.num_waiting -= 1
        self.num_running += 1

    def release(self) -> None:
        """Give back a slot taken by ``acquire``."""
        if self.num_running <= 0:
            raise RuntimeError("bug: Admission.release without a matching acquire")
        self.num_running -= 1
        self._free.release()

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """A slot held for the ``async with`` block."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()
