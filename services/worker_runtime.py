"""What prefill and decode workers share around their engine: registration and graceful stop.

A worker started with ``--redis-url`` registers itself (address, role, model fingerprint,
block size, capacity) and its heartbeat publishes its load and the block hashes its prefix
cache stores and evicts. On SIGTERM it first deregisters, so gateways stop routing to it
at once, then stops taking calls and lets running ones finish (``--drain-timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from services.common.registry import (
    RegistryPublisher,
    RegistryView,
    WorkerInfo,
    add_registry_args,
    advertised,
    new_worker_id,
)
from services.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

# Between deregistering and refusing calls: time for gateways to hear the "down" event.
_DEREGISTER_PAUSE_S = 0.3


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    add_registry_args(parser)
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish on SIGTERM",
    )


class RequestCounter:
    """Requests a worker has taken, for its registry entry (and tests reading it)."""

    def __init__(self) -> None:
        self.total = 0


def engine_publisher(
    ns: argparse.Namespace,
    role: str,
    host: str,
    port: int,
    engine: AsyncEngine,
    counter: RequestCounter,
) -> RegistryPublisher | None:
    """The worker's registry publisher, or None without ``--redis-url``."""
    if not ns.redis_url:
        return None
    e = engine.engine
    info = WorkerInfo(
        worker_id=new_worker_id(role),
        role=role,
        address=advertised(ns, host, port),
        model=e.model_config.path.name,
        fingerprint=e.model_config.fingerprint.hex(),
        block_size=e.args.block_size,
        num_total_blocks=e.pool.num_blocks,
        max_num_seqs=e.args.max_num_seqs,
    )

    async def load() -> dict:
        # Read between steps or not: counters and lengths, never torn under the GIL, and
        # no wait behind a long step.
        s = e.stats()
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_free_blocks": s.num_free_blocks,
            "num_cached_blocks": s.num_cached_blocks,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "requests_total": counter.total,
        }

    async def blocks(full: bool):
        return await engine.call(lambda e: e.drain_block_events(full))

    return RegistryPublisher(
        ns.redis_url, info, load, blocks, ttl_s=ns.registry_ttl, prefix=ns.redis_prefix
    )


def registry_view(ns: argparse.Namespace) -> RegistryView | None:
    """A view of the registry (a prefill worker's way to find kvstore replicas)."""
    if not ns.redis_url:
        return None
    return RegistryView(ns.redis_url, prefix=ns.redis_prefix)


async def serve_until_stopped(
    name: str,
    address: str,
    server: grpc.aio.Server,
    publisher: RegistryPublisher | None,
    stop: asyncio.Event,
    drain_timeout_s: float,
) -> None:
    """Register, print ``READY <name> <address>``, wait for SIGTERM/SIGINT, then
    deregister, report NOT_SERVING, drain running calls and stop."""
    if publisher is not None:
        await publisher.start()
    print(f"READY {name} {address}", flush=True)
    await stop.wait()
    if publisher is not None:
        await publisher.stop()
    await server.health_servicer.enter_graceful_shutdown()
    if publisher is not None:
        await asyncio.sleep(_DEREGISTER_PAUSE_S)
    logger.info("draining: running calls get %.0f s", drain_timeout_s)
    await server.stop(grace=drain_timeout_s)
