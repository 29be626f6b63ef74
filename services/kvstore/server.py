"""The KVStore gRPC service over a BlockStore: streamed puts and gets of KV blocks."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable

import grpc

from services.common.grpc_utils import STREAM_CHUNK_BYTES, start_server
from services.common.pb import common_pb2, kvstore_pb2, kvstore_pb2_grpc
from services.common.registry import RegistryPublisher
from services.engine.kv_transfer import BlockLayout
from services.kvstore.batching import batched_by_bytes
from services.kvstore.store import (
    BlockStore,
    LayoutMismatch,
    StoredBlock,
    layout_differences,
    layout_of,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.KVStore"
GRACE_S = 5.0


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """PutBlocks, GetBlocks and Stat over one BlockStore (one event loop: no locks)."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store

    async def PutBlocks(
        self,
        request_iterator: AsyncIterator[kvstore_pb2.PutBlocksRequest],
        context: grpc.aio.ServicerContext,
    ) -> kvstore_pb2.PutBlocksResponse:
        layout: BlockLayout | None = None
        num_stored = bytes_stored = 0
        async for request in request_iterator:
            if layout is None:
                if not request.HasField("layout"):
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "the first PutBlocks message must carry the block layout",
                    )
                layout = layout_of(request.layout)
            elif request.HasField("layout") and layout_of(request.layout) != layout:
                diffs = layout_differences(
                    layout, layout_of(request.layout), "first message", "this message"
                )
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "the block layout changed within one PutBlocks stream: " + "; ".join(diffs),
                )
            try:
                self._store.check_layout(layout)  # also when a message carries no blocks
                for block in request.blocks:
                    data = block.data  # upb copies on every access: read it once
                    self._store.put(layout, block.key, data, block.num_tokens)
                    num_stored += 1
                    bytes_stored += len(data)
            except LayoutMismatch as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        logger.debug("PutBlocks: stored %d blocks, %d bytes", num_stored, bytes_stored)
        return kvstore_pb2.PutBlocksResponse(num_stored=num_stored, bytes_stored=bytes_stored)

    async def GetBlocks(
        self, request: kvstore_pb2.GetBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.GetBlocksResponse]:
        if not request.HasField("layout"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "GetBlocks must carry the block layout"
            )
        layout = layout_of(request.layout)
        try:
            self._store.check_layout(layout)
        except LayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        found: list[tuple[bytes, StoredBlock]] = []
        missing: list[bytes] = []
        for key in request.keys:
            stored = self._store.get(layout, key)
            if stored is None:
                missing.append(key)
            else:
                found.append((key, stored))
        # Each message is built as it goes: protobuf copies every block's data into it.
        batches = list(batched_by_bytes(found, lambda b: len(b[1].data), STREAM_CHUNK_BYTES))
        batches = batches or [[]]
        for i, batch in enumerate(batches):
            yield _get_response(batch, missing if i == len(batches) - 1 else [])
        logger.debug("GetBlocks: %d found, %d missing", len(found), len(missing))

    async def Stat(
        self, request: kvstore_pb2.StatRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.StatResponse:
        s = self._store
        return kvstore_pb2.StatResponse(
            num_blocks=s.num_blocks,
            bytes_used=s.bytes_used,
            capacity_bytes=s.capacity_bytes,
            bytes_in=s.bytes_in,
            bytes_out=s.bytes_out,
            blocks_in=s.blocks_in,
            blocks_out=s.blocks_out,
            hits=s.hits,
            misses=s.misses,
            evictions=s.evictions,
        )


def _get_response(
    batch: list[tuple[bytes, StoredBlock]], missing: list[bytes]
) -> kvstore_pb2.GetBlocksResponse:
    return kvstore_pb2.GetBlocksResponse(
        blocks=[common_pb2.Block(key=k, data=b.data, num_tokens=b.num_tokens) for k, b in batch],
        missing=missing,
    )


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def serve(
    host: str,
    port: int,
    capacity_bytes: int,
    on_ready: Callable[[str], None] | None = None,
    registry: Callable[[str, BlockStore], RegistryPublisher | None] | None = None,
) -> None:
    """Serve a kvstore of ``capacity_bytes`` on host:port (0: a free port) until SIGTERM/SIGINT.

    ``on_ready`` gets the bound address once the server accepts calls; ``registry`` makes
    the publisher that registers it (None: not registered).
    """
    store = BlockStore(capacity_bytes)
    servicer = KVStoreServicer(store)
    server, bound_port = await start_server(  # OSError when it cannot bind
        host_port(host, port),
        [lambda s: kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, s)],
        [SERVICE_NAME],
    )
    address = host_port(host, bound_port)
    logger.info("kvstore serving on %s, capacity %d bytes", address, capacity_bytes)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    publisher = registry(address, store) if registry is not None else None
    if publisher is not None:
        await publisher.start()
    if on_ready is not None:
        on_ready(address)

    stopped = asyncio.ensure_future(stop.wait())
    terminated = asyncio.ensure_future(server.wait_for_termination())
    await asyncio.wait([stopped, terminated], return_when=asyncio.FIRST_COMPLETED)
    if publisher is not None:
        await publisher.stop()
    if stop.is_set():
        logger.info("kvstore stopping (grace %.0f s)", GRACE_S)
        await server.health_servicer.enter_graceful_shutdown()
        await server.stop(GRACE_S)
    for task in (stopped, terminated):
        task.cancel()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    logger.info("kvstore stopped")
