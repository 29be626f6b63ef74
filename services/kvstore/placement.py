"""Where a block goes: the one kvstore given by ``--kvstore``, or, with a registry, the
replica that owns its key by rendezvous hashing over the registered kvstore replicas."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence

from services.common.registry import RegistryView, rendezvous_owner
from services.kvstore.client import KVStoreClient


class KVStorePlacement:
    """Owners of block keys, and one client per kvstore address."""

    def __init__(self, static_address: str | None, view: RegistryView | None = None) -> None:
        if not static_address and view is None:
            raise ValueError("a kvstore placement needs an address or a registry view")
        self.static_address = static_address
        self.view = view
        self._clients: dict[str, KVStoreClient] = {}

    def owners(self, keys: Sequence[bytes]) -> list[str]:
        """The kvstore address of each key; LookupError when no replica is registered."""
        if self.static_address:
            return [self.static_address] * len(keys)
        replicas = self.view.workers("kvstore")
        if not replicas:
            raise LookupError(
                "no kvstore replica is registered in Redis: start one with "
                "`pdserve kvstore --redis-url URL`"
            )
        return [rendezvous_owner(key, replicas).address for key in keys]

    def client(self, address: str) -> KVStoreClient:
        if address not in self._clients:
            self._clients[address] = KVStoreClient(address)
        return self._clients[address]

    async def put(self, layout, blocks, addresses: Sequence[str], timeout: float) -> None:
        """Push each exported block to its address, the replicas in parallel."""
        groups = defaultdict(list)
        for block, address in zip(blocks, addresses, strict=True):
            groups[address].append((block.key, block.data, block.num_tokens))
        await asyncio.gather(
            *(
                self.client(address).put_blocks(layout, items, timeout=timeout)
                for address, items in groups.items()
            )
        )

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients))
