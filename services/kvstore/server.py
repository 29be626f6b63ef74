"""The kvstore service: streamed puts and gets of KV blocks over one in-memory BlockStore,
and an optional disk tier below it.

pdserve kvstore --port 50061 --capacity-bytes 2GiB [--block-lease 60] [--redis-url URL]
                [--block-layout L] [--disk-path DIR [--disk-capacity-bytes 8GiB]]

The store's block layout is ``--block-layout``, or the first put's; with an internal
token, only a caller holding it can make that first put. A block no get has taken within
``--block-lease`` seconds of its put expires (a timer looks every quarter lease, at most
every 5 s, so it goes within 1.25 leases); a get drops the blocks it names single-use.
With ``--disk-path``, what LRU evicts from memory is written there, and a get that misses
memory reads it there (in a thread) and promotes it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc

from pdserve.controlplane.publisher import publisher_for
from pdserve.kv.blocks import LAYOUT_VERSION, BlockLayout, LayoutMismatch, show_key
from pdserve.kv.client import batched_by_bytes
from pdserve.kv.convert import layout_from_proto
from pdserve.kvstore.disk import DiskTier, open_disk_tier
from pdserve.kvstore.metrics import KVStoreMetrics
from pdserve.kvstore.store import BlockStore, StoredBlock, layout_from_text, layout_to_text
from pdserve.runtime import tracing
from pdserve.runtime.metrics import metrics_server_address, start_metrics
from pdserve.runtime.rpc import STREAM_CHUNK_BYTES, start_server
from pdserve.runtime.service import Serving, run_service
from pdserve.runtime.trust import load_trust
from pdserve.settings.process import host_port
from pdserve.settings.services import KVStoreSettings
from pdserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.KVStore"


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """PutBlocks, GetBlocks and Stat over one BlockStore (one event loop: no locks) and the
    DiskTier its evictions go to, if any."""

    def __init__(
        self,
        store: BlockStore,
        metrics: KVStoreMetrics | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        self._store = store
        self._disk = disk
        self.metrics = metrics or KVStoreMetrics(store, disk)

    async def PutBlocks(
        self,
        request_iterator: AsyncIterator[kvstore_pb2.PutBlocksRequest],
        context: grpc.aio.ServicerContext,
    ) -> kvstore_pb2.PutBlocksResponse:
        parent = tracing.from_grpc(context.invocation_metadata())
        with (
            tracing.start_span("kvstore.put", parent, kind=tracing.SERVER) as span,
            self.metrics.put_seconds.time(),
        ):
            response = await self._put(request_iterator, context)
            if span.is_recording():
                span.set_attributes(
                    {
                        "pdserve.kvstore.blocks": response.num_stored,
                        "pdserve.kvstore.bytes": response.bytes_stored,
                    }
                )
            return response

    async def _put(
        self,
        request_iterator: AsyncIterator[kvstore_pb2.PutBlocksRequest],
        context: grpc.aio.ServicerContext,
    ) -> kvstore_pb2.PutBlocksResponse:
        layout: BlockLayout | None = None
        layout_proto = common_pb2.BlockLayout()
        num_stored = bytes_stored = 0
        async for request in request_iterator:
            if layout is None:
                if not request.HasField("layout"):
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "the first PutBlocks message must carry the block layout",
                    )
                layout = layout_from_proto(request.layout)
                layout_proto.CopyFrom(request.layout)
            elif request.HasField("layout") and layout_from_proto(request.layout) != layout:
                diffs = layout.differences(
                    layout_from_proto(request.layout), "first message", "this message"
                )
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "the block layout changed within one PutBlocks stream: " + "; ".join(diffs),
                )
            try:
                self._store.check_layout(layout)  # also when a message carries no blocks
                for block in request.blocks:
                    _check_header(block, layout_proto)
                    data = block.data  # upb copies on every access: read it once
                    self._store.put(layout, block.key, data, block.num_tokens, block.checksum)
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
        parent = tracing.from_grpc(context.invocation_metadata())
        with (
            tracing.start_span("kvstore.get", parent, kind=tracing.SERVER) as span,
            self.metrics.get_seconds.time(),
        ):
            async for response in self._get(request, context, span):
                yield response

    async def _get(
        self,
        request: kvstore_pb2.GetBlocksRequest,
        context: grpc.aio.ServicerContext,
        span: object,
    ) -> AsyncIterator[kvstore_pb2.GetBlocksResponse]:
        if not request.HasField("layout"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "GetBlocks must carry the block layout"
            )
        layout = layout_from_proto(request.layout)
        try:
            self._store.check_layout(layout)
        except LayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        single_use = set(request.single_use)
        held: dict[bytes, StoredBlock] = {}
        for key in request.keys:
            stored = self._store.get(layout, key, single_use=key in single_use)
            if stored is not None:
                held[key] = stored
        if self._disk is not None and len(held) < len(request.keys):
            held.update(await self._from_disk(layout, request.keys, held, single_use))
        found = [(key, held[key]) for key in request.keys if key in held]
        missing = [key for key in request.keys if key not in held]
        # Each message is built as it goes: protobuf copies every block's data into it.
        batches = list(batched_by_bytes(found, lambda b: len(b[1].data), STREAM_CHUNK_BYTES))
        batches = batches or [[]]
        for i, batch in enumerate(batches):
            yield _get_response(request.layout, batch, missing if i == len(batches) - 1 else [])
        logger.debug("GetBlocks: %d found, %d missing", len(found), len(missing))
        if span.is_recording():
            span.set_attributes(
                {
                    "pdserve.kvstore.blocks": len(found),
                    "pdserve.kvstore.bytes": sum(len(b.data) for _, b in found),
                    "pdserve.kvstore.missing": len(missing),
                }
            )

    async def _from_disk(
        self,
        layout: BlockLayout,
        keys: Sequence[bytes],
        held: dict[bytes, StoredBlock],
        single_use: set[bytes],
    ) -> dict[bytes, StoredBlock]:
        """The blocks of ``keys`` not ``held`` in memory that the disk tier has, promoted
        back into memory (a single-use one is served and deleted)."""
        wanted = [key for key in keys if key not in held and key in self._disk]
        if not wanted:  # a miss everywhere costs no thread
            return {}
        found = await asyncio.to_thread(self._disk.read_many, wanted)
        for key, block in found.items():
            self._store.promote(layout, key, block, single_use=key in single_use)
            if key in single_use:
                self._disk.discard(key)
        return found

    async def Stat(
        self, request: kvstore_pb2.StatRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.StatResponse:
        s, d = self._store, self._disk
        s.expire()
        disk = {}
        if d is not None:
            disk = {
                "disk_blocks": d.num_blocks,
                "disk_bytes_used": d.bytes_used,
                "disk_capacity_bytes": d.capacity_bytes,
                "disk_hits": d.hits,
                "disk_writes": d.writes,
                "disk_writes_dropped": d.writes_dropped,
                "disk_damaged": d.damaged,
                "disk_evictions": d.evictions,
            }
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
            expired=s.expired,
            dropped=s.dropped,
            num_leased=s.num_leased,
            **disk,
        )


async def expire_leases(store: BlockStore, period_s: float) -> None:
    """Every ``period_s``, drop the blocks whose lease has ended (until cancelled)."""
    while True:
        await asyncio.sleep(period_s)
        n = store.expire()
        if n:
            logger.debug("expired %d blocks no get took within their lease", n)


def lease_check_period(lease_s: float) -> float:
    """How often the lease timer looks: a quarter lease, within [50 ms, 5 s]."""
    return min(max(lease_s / 4, 0.05), 5.0)


def _check_header(block: common_pb2.Block, stream_layout: common_pb2.BlockLayout) -> None:
    """ValueError unless ``block`` carries a checksum and a header equal to its stream's layout
    (checksums are the receiver's to verify: the decode worker checks them end to end)."""
    if not block.HasField("layout") or not block.HasField("checksum"):
        raise ValueError(
            f"block {show_key(block.key)} carries no layout header or no checksum (layout "
            f"version {LAYOUT_VERSION} needs both): run one pdserve version on every worker"
        )
    if block.layout != stream_layout:
        diffs = layout_from_proto(stream_layout).differences(
            layout_from_proto(block.layout), "stream", "block"
        )
        raise ValueError(
            f"block {show_key(block.key)} has another layout than its stream: " + "; ".join(diffs)
        )


def _get_response(
    layout: common_pb2.BlockLayout, batch: list[tuple[bytes, StoredBlock]], missing: list[bytes]
) -> kvstore_pb2.GetBlocksResponse:
    # Every stored block's header was checked equal to the store's layout, ``layout`` here.
    return kvstore_pb2.GetBlocksResponse(
        blocks=[
            common_pb2.Block(
                key=k, data=b.data, num_tokens=b.num_tokens, layout=layout, checksum=b.checksum
            )
            for k, b in batch
        ],
        missing=missing,
    )


class BlockIndex:
    """The block keys this kvstore holds (memory and disk, tails aside), as the registry's
    block set of its entry: what routers credit prefill workers with (they can fetch it)."""

    def __init__(self, store: BlockStore, disk: DiskTier | None) -> None:
        self.store, self.disk = store, disk
        self.published: set[bytes] = set()

    def changes(self, full: bool) -> tuple[list[bytes], list[bytes]]:
        """(stored, evicted) since the last call; with ``full``, every key (and none evicted)."""
        held = {k for k in self.store.lru_order() if not k.startswith(b"tail/")}
        if self.disk is not None:
            held.update(self.disk.lru_order())
        if full:
            self.published = held
            return list(held), []
        stored, evicted = held - self.published, self.published - held
        self.published = held
        return list(stored), list(evicted)


async def _persist(store: BlockStore, disk: DiskTier) -> None:
    """Write the blocks memory holds to the disk tier as the kvstore stops."""
    if store.layout is None:
        return
    blocks = [(key, store.peek(key)) for key in store.lru_order()]
    written = await asyncio.to_thread(disk.persist, store.layout, blocks)
    logger.info("disk tier: wrote %d blocks held in memory as the kvstore stops", written)


async def start(settings: KVStoreSettings, resources: contextlib.AsyncExitStack) -> Serving:
    """A kvstore of ``--capacity-bytes`` serving on its port, registered when --redis-url."""
    trust = load_trust(settings.security)
    layout = layout_from_text(settings.block_layout) if settings.block_layout else None
    lease = settings.block_lease or None
    disk = None
    if settings.disk_path:
        disk = await asyncio.to_thread(
            open_disk_tier, Path(settings.disk_path), settings.disk_capacity, layout
        )
        layout = disk.layout
        disk.start()
        resources.push_async_callback(asyncio.to_thread, disk.close)  # after the server stops
    store = BlockStore(settings.capacity, layout, lease, on_evict=disk.offer if disk else None)
    if disk is not None:  # released before disk.close: memory's blocks go to disk on stop
        resources.push_async_callback(_persist, store, disk)
    servicer = KVStoreServicer(store, disk=disk)
    metrics_server = start_metrics(settings, servicer.metrics.registry, resources)
    host = settings.server.host
    server, port = await start_server(  # OSError when it cannot bind
        host_port(host, settings.server.port),
        [lambda s: kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        credentials=trust.server_credentials,
        token=trust.tokens,
    )
    resources.push_async_callback(server.stop, None)
    if lease is not None:
        timer = asyncio.create_task(expire_leases(store, lease_check_period(lease)))
        resources.callback(timer.cancel)
    logger.info(
        "kvstore on %s, capacity %d bytes, block lease %s, block layout %s, %s; %s",
        host_port(host, port),
        store.capacity_bytes,
        f"{lease:g} s" if lease else "off",
        layout_to_text(layout) if layout else "from the first put",
        _describe(disk),
        trust.describe(),
    )

    async def load() -> dict:
        return {"bytes_used": store.bytes_used, "num_cached_blocks": store.num_blocks}

    index = BlockIndex(store, disk)

    async def blocks(full: bool) -> tuple[list[bytes], list[bytes]]:
        return index.changes(full)

    metrics_address = metrics_server_address(settings, metrics_server)
    publisher = publisher_for(
        settings.registry,
        "kvstore",
        host,
        port,
        load,
        blocks,
        token=trust.tokens,
        capacity_bytes=store.capacity_bytes,
        metrics_address=metrics_address,
    )
    serving = Serving(server, port, publisher)
    if metrics_server is not None:
        metrics_server.health = lambda: not serving.draining
    if metrics_address:
        serving.ready_lines.append(("kvstore-metrics", metrics_address))
    return serving


def _describe(disk: DiskTier | None) -> str:
    if disk is None:
        return "no disk tier"
    return (
        f"disk tier {disk.root} of {disk.capacity_bytes} bytes holding {disk.num_blocks} "
        f"blocks, {disk.bytes_used} bytes"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`pdserve kvstore`."""
    return run_service(
        "kvstore",
        KVStoreSettings,
        argv,
        "Serve the KV block store: prefill workers put a prompt's KV blocks, decode workers "
        "get them; least recently used blocks go first when --capacity-bytes is full (to "
        "--disk-path, if given), and a block no get took within --block-lease expires.",
        start,
    )


if __name__ == "__main__":
    sys.exit(main())
