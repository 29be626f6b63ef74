"""The kvstores a decode worker may fetch from, and no other: a request naming another is
refused before any connection (the worker would send it the internal token)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.controlplane.view import RegistryView

_MAX_SEEN_KVSTORES = 4096


class KnownKVStores:
    """The kvstores a decode worker may fetch from: ``--kvstore``, and every replica the
    registry has listed while it ran (one that left since costs a recompute, not the
    request)."""

    def __init__(self, static: Sequence[str], view: RegistryView | None = None) -> None:
        self.static = frozenset(static)
        self.view = view
        self._seen: dict[str, None] = {}  # an ordered set, oldest first

    def _known(self) -> set[str]:
        if self.view is not None:
            for replica in self.view.workers("kvstore"):
                self._seen.pop(replica.address, None)
                self._seen[replica.address] = None
            while len(self._seen) > _MAX_SEEN_KVSTORES:
                del self._seen[next(iter(self._seen))]
        return {*self.static, *self._seen}

    async def unknown(self, addresses: set[str]) -> list[str]:
        """Those of ``addresses`` that are no kvstore this worker knows, sorted; the registry
        is read again first when one is new to it (a replica that has just joined)."""
        strangers = addresses - self._known()
        if strangers and self.view is not None:
            await self.view.refresh()
            strangers = addresses - self._known()
        return sorted(strangers)

    def describe(self) -> str:
        """Where this worker's kvstores come from, for an error."""
        sources = [f"--kvstore {', '.join(sorted(self.static))}"] if self.static else []
        if self.view is not None:
            sources.append("the replicas registered in --redis-url")
        return " and ".join(sources) or "none: pass --kvstore HOST:PORT or --redis-url"
