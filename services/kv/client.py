"""Clients of the kvstore: puts and gets of KV blocks streamed in messages of a few MiB, and
where each block goes (``KVStorePlacement``). Prefill and decode workers use these; the
kvstore server shares ``batched_by_bytes`` to stream its answers."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import grpc

from pdserve.controlplane.registry import rendezvous_owner
from pdserve.controlplane.view import RegistryView
from pdserve.kv.blocks import FetchedBlocks, block_checksum, block_problem
from pdserve.kv.convert import layout_from_proto
from pdserve.runtime.rpc import STREAM_CHUNK_BYTES, aio_channel
from pdserve.runtime.trust import Trust
from pdserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc

T = TypeVar("T")


def batched_by_bytes(
    items: Iterable[T], size: Callable[[T], int], max_bytes: int
) -> Iterator[list[T]]:
    """Consecutive non-empty batches of at most ``max_bytes``; an item larger than that goes alone."""
    batch: list[T] = []
    batch_bytes = 0
    for item in items:
        n = size(item)
        if batch and batch_bytes + n > max_bytes:
            yield batch
            batch, batch_bytes = [], 0
        batch.append(item)
        batch_bytes += n
    if batch:
        yield batch


BlockIn = tuple[bytes, bytes | memoryview, int]
"""(key, data, num_tokens) of one block to put."""
Metadata = tuple[tuple[str, str], ...] | None


def _check_timeout(timeout: float) -> None:
    if not timeout > 0:
        raise ValueError(f"a kvstore call needs a positive timeout in seconds, got {timeout!r}")


def block_checksums(blocks: Sequence[BlockIn]) -> list[int]:
    """Each block's ``block_checksum``."""
    return [block_checksum(k, n, d) for k, d, n in blocks]


def put_requests(
    layout: common_pb2.BlockLayout,
    blocks: Sequence[BlockIn],
    checksums: Sequence[int] | None = None,
) -> Iterator[kvstore_pb2.PutBlocksRequest]:
    """PutBlocks messages of at most STREAM_CHUNK_BYTES of data each; the first carries the
    layout, every block its header (the layout) and its checksum (computed here unless given)."""
    if checksums is None:
        checksums = block_checksums(blocks)
    # protobuf takes bytes only: a memoryview costs one copy here.
    as_bytes = (
        (k, d if isinstance(d, bytes) else bytes(d), n, c)
        for (k, d, n), c in zip(blocks, checksums, strict=True)
    )
    # Only the first message carries the layout; with no blocks it still goes, alone.
    first = True
    for batch in batched_by_bytes(as_bytes, lambda b: len(b[1]), STREAM_CHUNK_BYTES):
        request = kvstore_pb2.PutBlocksRequest(
            blocks=[
                common_pb2.Block(key=k, data=d, num_tokens=n, layout=layout, checksum=c)
                for k, d, n, c in batch
            ]
        )
        if first:
            request.layout.CopyFrom(layout)
            first = False
        yield request
    if first:
        yield kvstore_pb2.PutBlocksRequest(layout=layout)


class KVStoreClient:
    """A channel to one kvstore. Every call takes a deadline; errors raise grpc.aio.AioRpcError."""

    def __init__(self, address: str, trust: Trust | None = None) -> None:
        self.address = address
        self._trust = trust
        self._generation = trust.generation if trust is not None else 0
        self._channel = aio_channel(address, trust)
        self._kv_stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._retired: list = []  # channels replaced after a TLS rotation: calls run on

    @property
    def _stub(self) -> kvstore_pb2_grpc.KVStoreStub:
        """The stub of a channel dialling with the TLS files in use (a new one after they
        rotated)."""
        if self._trust is not None and self._trust.generation != self._generation:
            self._generation = self._trust.generation
            self._retired.append(self._channel)
            self._channel = aio_channel(self.address, self._trust)
            self._kv_stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        return self._kv_stub

    async def put_blocks(
        self,
        layout: common_pb2.BlockLayout,
        blocks: Sequence[BlockIn],
        timeout: float,
        metadata: Metadata = None,
    ) -> kvstore_pb2.PutBlocksResponse:
        """Store ``blocks`` (replacing blocks with the same key) under ``layout``.
        ``metadata``: sent with the call (a trace context)."""
        _check_timeout(timeout)
        # Off the event loop (and any engine thread): zlib.crc32 releases the GIL.
        checksums = await asyncio.to_thread(block_checksums, blocks)
        return await self._stub.PutBlocks(
            put_requests(layout, blocks, checksums), timeout=timeout, metadata=metadata
        )

    async def get_blocks(
        self,
        layout: common_pb2.BlockLayout,
        keys: Sequence[bytes],
        timeout: float,
        single_use: Sequence[bytes] = (),
        metadata: Metadata = None,
    ) -> FetchedBlocks:
        """The blocks under ``keys``: those whose header, length and checksum are those of a
        sound block of ``layout``, those that are not (``rejected``, with why), and the keys
        the store does not have. ``single_use``: keys nobody will ask for again (a request's
        tail), which the store drops once read."""
        _check_timeout(timeout)
        expected = layout_from_proto(layout)
        fetched = FetchedBlocks()
        request = kvstore_pb2.GetBlocksRequest(layout=layout, keys=keys, single_use=single_use)
        call = self._stub.GetBlocks(request, timeout=timeout, metadata=metadata)
        async for response in call:
            # upb copies a bytes field on every access: each field is read once, here.
            received = [
                (
                    b.key,
                    b.data,
                    b.num_tokens,
                    layout_from_proto(b.layout) if b.HasField("layout") else None,
                    b.checksum if b.HasField("checksum") else None,
                )
                for b in response.blocks
            ]
            # Checksums off the event loop, one message (a few MiB) at a time.
            problems = await asyncio.to_thread(
                lambda r=received: [block_problem(expected, *block) for block in r]
            )
            for (key, data, *_), problem in zip(received, problems, strict=True):
                if problem is None:
                    fetched.found[key] = data
                else:
                    fetched.rejected[key] = problem
            fetched.missing.extend(response.missing)
        return fetched

    async def stat(self, timeout: float) -> kvstore_pb2.StatResponse:
        """The store's counters."""
        _check_timeout(timeout)
        return await self._stub.Stat(kvstore_pb2.StatRequest(), timeout=timeout)

    async def close(self) -> None:
        for channel in (*self._retired, self._channel):
            await channel.close()

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


GetResult = tuple[list[bytes], "FetchedBlocks | grpc.aio.AioRpcError"]


async def get_grouped(
    client: Callable[[str], KVStoreClient],
    layout: common_pb2.BlockLayout,
    keys: Sequence[bytes],
    addresses: Sequence[str],
    timeout: float,
    single_use: Sequence[bytes] = (),
    metadata: Metadata = None,
) -> dict[str, GetResult]:
    """Each key from its kvstore (``addresses``, one per key; "" has none), the replicas in
    parallel through ``client(address)``: by address, the keys asked for and what came back,
    or the gRPC error that ended that replica's get. Other errors are raised."""
    by_address: dict[str, list[bytes]] = {}
    for key, address in zip(keys, addresses, strict=True):
        if address:
            by_address.setdefault(address, []).append(key)
    results = await asyncio.gather(
        *(
            client(address).get_blocks(
                layout,
                wanted,
                timeout=timeout,
                single_use=[k for k in single_use if k in wanted],
                metadata=metadata,
            )
            for address, wanted in by_address.items()
        ),
        return_exceptions=True,
    )
    out = {}
    for (address, wanted), result in zip(by_address.items(), results, strict=True):
        if isinstance(result, BaseException) and not isinstance(result, grpc.aio.AioRpcError):
            raise result
        out[address] = (wanted, result)
    return out


class KVStorePlacement:
    """Owners of block keys, and one client per kvstore address."""

    def __init__(
        self,
        static_address: str | None,
        view: RegistryView | None = None,
        trust: Trust | None = None,
    ) -> None:
        if not static_address and view is None:
            raise ValueError("a kvstore placement needs an address or a registry view")
        self.static_address = static_address
        self.view = view
        self.trust = trust
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
            self._clients[address] = KVStoreClient(address, self.trust)
        return self._clients[address]

    async def put(
        self, layout, blocks, addresses: Sequence[str], timeout: float, metadata: Metadata = None
    ) -> dict[str, grpc.aio.AioRpcError]:
        """Push each exported block to its address, the replicas in parallel; the replicas
        whose push failed (their blocks may be lost: a decode worker recomputes them), with
        why. Errors other than gRPC's are raised."""
        groups = defaultdict(list)
        for block, address in zip(blocks, addresses, strict=True):
            groups[address].append((block.key, block.data, block.num_tokens))
        results = await asyncio.gather(
            *(
                self.client(address).put_blocks(layout, items, timeout=timeout, metadata=metadata)
                for address, items in groups.items()
            ),
            return_exceptions=True,
        )
        failed = {}
        for address, result in zip(groups, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError):
                failed[address] = result
            elif isinstance(result, BaseException):
                raise result
        return failed

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients))
