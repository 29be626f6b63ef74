"""RegistryPublisher: one worker's (or kvstore's) entry in the registry, kept fresh by a
heartbeat until the worker stops (see ``pdserve.controlplane.registry`` for the keys)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pdserve.controlplane.registry import (
    DEFAULT_PREFIX,
    DEFAULT_TTL_S,
    Keys,
    WorkerInfo,
    advertised_address,
    connect,
    new_worker_id,
    redis_errors,
)
from pdserve.controlplane.signing import Tokens, registry_key, signed_json
from pdserve.settings.redaction import redact_url

logger = logging.getLogger(__name__)

LoadFn = Callable[[], Awaitable[dict]]
BlocksFn = Callable[[bool], Awaitable[tuple[list[bytes], list[bytes]]]]


class RegistryPublisher:
    """Registers one worker and keeps its entry (and its block set) fresh until stopped."""

    def __init__(
        self,
        url: str,
        info: WorkerInfo,
        load: LoadFn | None = None,
        blocks: BlocksFn | None = None,
        ttl_s: float = DEFAULT_TTL_S,
        prefix: str = DEFAULT_PREFIX,
        key: bytes | Callable[[], bytes | None] | None = None,
    ) -> None:
        """``key``: what the entry and events are signed with (``signing.registry_key`` of
        the internal token, or a function giving it as the token rotates; None: an open
        cluster, unsigned)."""
        if ttl_s <= 0:
            raise ValueError(f"--registry-ttl must be positive, got {ttl_s}")
        self.info = info
        self.info.pid = os.getpid()
        self.info.started_at = time.time()
        self.ttl_s = ttl_s
        # Four beats per TTL, but at least 5 a second: routing reads the block sets.
        self.interval_s = min(ttl_s / 4, 0.2)
        self.keys = Keys(prefix)
        self._key = key if callable(key) else lambda: key
        self._redis = connect(url)
        self._url = redact_url(url)  # for logs only
        self._load = load
        self._blocks = blocks
        self._resync = True
        self._down_since: float | None = None
        self._task: asyncio.Task | None = None
        self._drain: asyncio.Future | None = None
        self._drain_full = False
        self._stopping = False

    async def start(self) -> None:
        """Register now if Redis answers, and keep beating in the background either way."""
        await self.beat()
        self._task = asyncio.create_task(self._run(), name=f"registry-{self.info.worker_id}")

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.interval_s)
            await self.beat()

    async def beat(self) -> None:
        """One heartbeat: renew the entry with fresh load; apply block events (all blocks
        when re-registering). Never raises for Redis trouble: it logs once per outage."""
        full, stored, evicted = await self._gather()
        try:
            self.info.seq += 1
            self.info.updated_at = time.time()
            old = await asyncio.wait_for(self._write(full, stored, evicted), timeout=2.0)
        except redis_errors() as e:
            self._resync = True  # events drained this beat are lost: rewrite all next time
            if self._down_since is None:
                self._down_since = time.monotonic()
                logger.warning(
                    "registry: Redis at %s is unreachable (%s); serving on, retrying",
                    self._url,
                    e or type(e).__name__,
                )
            return
        if self._down_since is not None:
            logger.warning(
                "registry: Redis is back after %.1f s", time.monotonic() - self._down_since
            )
            self._down_since = None
        if full:
            self._resync = False
        elif old is None:
            # Our entry was missing: a Redis restart, or an expiry. The block set may be
            # gone with it: rewrite it in full at the next beat.
            self._resync = True
        if old is None:
            with contextlib.suppress(*redis_errors()):
                await self._redis.publish(self.keys.events, self._event("up"))

    async def _gather(self) -> tuple[bool, list[bytes], list[bytes]]:
        """The worker's load, and its block events when the engine has handed them over.

        The drain runs on the engine thread between steps; a beat waits for it at most one
        interval and otherwise goes out without block changes (a later beat writes them),
        so a long engine step never holds up the heartbeat. Returns (full, stored, evicted).
        """
        if self._load is not None:
            for name, value in (await self._load()).items():
                setattr(self.info, name, value)
        if self._blocks is None:
            return self._resync, [], []
        if self._drain is None:
            self._drain_full = self._resync
            self._drain = asyncio.ensure_future(self._blocks(self._drain_full))
        await asyncio.wait({self._drain}, timeout=self.interval_s)
        if not self._drain.done():
            return False, [], []
        drain, self._drain = self._drain, None
        stored, evicted = drain.result()
        return self._drain_full, stored, evicted

    async def _write(self, full: bool, stored: list[bytes], evicted: list[bytes]):
        ttl_ms = int(self.ttl_s * 1000)
        blocks_key = self.keys.blocks(self.info.worker_id)
        pipe = self._redis.pipeline(transaction=True)
        entry = self.info.to_json(self._key())
        pipe.set(self.keys.worker(self.info.worker_id), entry, px=ttl_ms, get=True)
        if full:
            pipe.delete(blocks_key)
        if stored:
            pipe.sadd(blocks_key, *stored)
        if evicted:
            pipe.srem(blocks_key, *evicted)
        pipe.pexpire(blocks_key, ttl_ms)
        return (await pipe.execute())[0]

    def _event(self, kind: str) -> str:
        return signed_json({"kind": kind, "id": self.info.worker_id}, self._key())

    async def stop(self) -> None:
        """Deregister (delete the entry and block set, announce ``down``) and stop beating."""
        self._stopping = True
        if self._drain is not None:
            self._drain.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        worker_id = self.info.worker_id
        try:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(self.keys.worker(worker_id), self.keys.blocks(worker_id))
            pipe.publish(self.keys.events, self._event("down"))
            await asyncio.wait_for(pipe.execute(), timeout=2.0)
        except redis_errors() as e:
            logger.warning("registry: could not deregister %s (%s); its TTL will", worker_id, e)
        await self._redis.aclose()


def publisher_for(
    registry: Any,
    role: str,
    host: str,
    port: int,
    load: LoadFn | None = None,
    blocks: BlocksFn | None = None,
    worker_id: str | None = None,
    token: Tokens | None = None,
    **info: Any,
) -> RegistryPublisher | None:
    """The publisher of a ``role`` process bound to host:port, under its RegistrySettings;
    None without ``--redis-url``. ``worker_id``: its id (default: a new one); ``token``: the
    internal token its entry is signed with (``signing``); ``info``: the entry's fixed
    fields (model, capacity, metrics address...)."""
    url = registry.redis.redis_url
    if not url:
        return None
    entry = WorkerInfo(
        worker_id=worker_id or new_worker_id(role),
        role=role,
        address=advertised_address(registry.advertise_address, host, port),
        **info,
    )
    return RegistryPublisher(
        url,
        entry,
        load,
        blocks,
        ttl_s=registry.registry_ttl,
        prefix=registry.redis.redis_prefix,
        key=(lambda: registry_key(token.sent())) if token is not None else None,
    )
