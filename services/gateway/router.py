"""Which prefill and which decode worker serves a request: round-robin over fixed pools.

The Redis registry and prefix-aware scoring come later, behind the same two methods.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


class NoWorkerError(RuntimeError):
    """A pool has no worker to route to."""


class Router:
    """Round-robin over the prefill and decode worker addresses it was given."""

    def __init__(self, prefill_addrs: Sequence[str], decode_addrs: Sequence[str]) -> None:
        self.prefill_addrs = tuple(prefill_addrs)
        self.decode_addrs = tuple(decode_addrs)
        self._prefill = itertools.cycle(self.prefill_addrs)
        self._decode = itertools.cycle(self.decode_addrs)

    def pick_prefill(self) -> str:
        """The address of the next prefill worker."""
        if not self.prefill_addrs:
            raise NoWorkerError("no prefill worker: start one and pass its address with --prefill")
        return next(self._prefill)

    def pick_decode(self) -> str:
        """The address of the next decode worker."""
        if not self.decode_addrs:
            raise NoWorkerError("no decode worker: start one and pass its address with --decode")
        return next(self._decode)
