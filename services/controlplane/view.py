"""RegistryView: a gateway's (or prefill worker's) live copy of the registry: who serves,
how loaded, and which prompt prefixes their caches hold (keys in ``pdserve.controlplane.registry``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.controlplane.registry import (
    DEFAULT_PREFIX,
    DEFAULT_TTL_S,
    Keys,
    WorkerInfo,
    connect,
    redis_errors,
)
from pdserve.controlplane.signing import Verifier
from pdserve.settings.redaction import redact_url

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    info: WorkerInfo
    expires_at: float  # loop time at which Redis drops the key, as of the last poll


@dataclass
class RegistryView:
    """A live, local copy of the registry: entries whose TTL has not run out, and, in a
    cluster with an internal token, whose signature is the cluster's (``signing``)."""

    url: str = field(repr=False)  # may hold a password: see shown_url
    prefix: str = DEFAULT_PREFIX
    verifier: Verifier = field(default_factory=Verifier)
    refresh_s: float = 0.5
    query_timeout_s: float = 0.25
    recovery_grace_s: float = DEFAULT_TTL_S
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _gone: deque = field(default_factory=lambda: deque(maxlen=4096))
    _unreachable: dict[str, int] = field(default_factory=dict)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    redis_ok: bool = False
    _closed: bool = False
    _recovered_until: float = 0.0
    _refused: dict[str, str] = field(default_factory=dict)  # key -> why, warned once

    def __post_init__(self) -> None:
        self.keys = Keys(self.prefix)
        self._redis = connect(self.url)
        self.shown_url = redact_url(self.url)  # what logs and errors print
        self._poke = asyncio.Event()
        self.changed = asyncio.Event()  # set after each poll or event that changed entries

    async def start(self) -> None:
        """Read the registry once (an unreachable Redis leaves the view empty for now), then
        follow it: pub/sub events and a poll every ``refresh_s``."""
        await self.refresh()
        self._tasks = [
            asyncio.create_task(self._poll_loop(), name="registry-poll"),
            asyncio.create_task(self._event_loop(), name="registry-events"),
        ]

    async def close(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, *redis_errors()):
                await task
        await self._redis.aclose()

    # --- reading -------------------------------------------------------------------

    def workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Live entries (all known ones while Redis is unreachable), minus workers a caller
        found unreachable that have not heartbeaten since; sorted by id."""
        now = asyncio.get_running_loop().time()
        out = []
        for worker_id, entry in sorted(self._entries.items()):
            if role is not None and entry.info.role != role:
                continue
            if self.redis_ok and entry.expires_at <= now:
                continue
            seen = self._unreachable.get(worker_id)
            if seen is not None and entry.info.seq < seen + 2:
                continue
            out.append(entry.info)
        return out

    def describe(self, role: str) -> str:
        """Why there is no worker of ``role``, for the client's error."""
        if not self.redis_ok and not self._entries:
            return f"no {role} worker known: Redis at {self.shown_url} is unreachable"
        return (
            f"no live {role} worker is registered in Redis at {self.shown_url} (prefix "
            f"{self.prefix!r}): start one with `pdserve {role} --redis-url {self.shown_url}`"
        )

    def mark_unreachable(self, worker_id: str) -> None:
        """A call to this worker failed to connect: skip it until two fresh heartbeats."""
        entry = self._entries.get(worker_id)
        if entry is not None:
            self._unreachable[worker_id] = entry.info.seq

    async def prefix_lengths(
        self, workers: Sequence[WorkerInfo], hashes: Callable[[int], Sequence[bytes]]
    ) -> dict[str, int]:
        """How many leading blocks of a prompt each worker's prefix cache holds.

        ``hashes(block_size)`` gives the prompt's full-block hashes for that block size.
        One round trip; on any Redis trouble, ``{}`` (routing then weighs load alone)."""
        asked = [(w, hashes(w.block_size)) for w in workers if w.block_size > 0]
        asked = [(w, h) for w, h in asked if h]
        if not asked:
            return {}
        try:
            pipe = self._redis.pipeline(transaction=False)
            for w, h in asked:
                pipe.smismember(self.keys.blocks(w.worker_id), list(h))
            results = await asyncio.wait_for(pipe.execute(), timeout=self.query_timeout_s)
        except redis_errors() as e:
            logger.debug("registry: prefix query failed (%s); routing by load", e)
            return {}
        out = {}
        for (w, _), held in zip(asked, results, strict=True):
            n = 0
            for hit in held:
                if not hit:
                    break
                n += 1
            out[w.worker_id] = n
        return out

    async def fetchable_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` the kvstore replicas hold between them (each
        publishes its block set as workers do): a prefill worker fetches those instead of
        computing them. One round trip; on any Redis trouble, 0."""
        replicas = self.workers("kvstore")
        if not replicas or not hashes:
            return 0
        try:
            pipe = self._redis.pipeline(transaction=False)
            for replica in replicas:
                pipe.smismember(self.keys.blocks(replica.worker_id), list(hashes))
            results = await asyncio.wait_for(pipe.execute(), timeout=self.query_timeout_s)
        except redis_errors() as e:
            logger.debug("registry: kvstore block query failed (%s)", e)
            return 0
        n = 0
        while n < len(hashes) and any(held[n] for held in results):
            n += 1
        return n

    # --- following -----------------------------------------------------------------

    async def refresh(self) -> None:
        """Read every entry with its remaining TTL; keep the old view if Redis fails."""
        try:
            entries = await asyncio.wait_for(self._read_all(), timeout=max(self.refresh_s, 1.0))
        except redis_errors() as e:
            if self.redis_ok:
                logger.warning(
                    "registry: Redis at %s is unreachable (%s); keeping the last known %d workers",
                    self.shown_url,
                    e or type(e).__name__,
                    len(self._entries),
                )
            self.redis_ok = False
            return
        now = asyncio.get_running_loop().time()
        if not self.redis_ok and self._entries:
            # A restarted Redis is empty until each worker's next heartbeat: keep the last
            # known workers for one TTL more, as if Redis had never gone.
            logger.warning("registry: Redis is back; %d workers registered", len(entries))
            self._recovered_until = now + self.recovery_grace_s
        self.redis_ok = True
        gone = set(self._gone)
        before = {k: e.info.seq for k, e in self._entries.items()}
        if now < self._recovered_until:
            for worker_id, old in self._entries.items():
                if worker_id not in entries:
                    entries[worker_id] = _Entry(old.info, self._recovered_until)
        self._entries = {k: e for k, e in entries.items() if k not in gone}
        for worker_id in list(self._unreachable):
            if worker_id not in self._entries:
                del self._unreachable[worker_id]
        if before != {k: e.info.seq for k, e in self._entries.items()}:
            self.changed.set()

    async def _read_all(self) -> dict[str, _Entry]:
        keys = [k async for k in self._redis.scan_iter(match=self.keys.worker_pattern, count=500)]
        if not keys:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
            pipe.pttl(key)
        values = await pipe.execute()
        now = asyncio.get_running_loop().time()
        entries, refused = {}, {}
        for i in range(0, len(values), 2):
            raw, pttl = values[i], values[i + 1]
            if raw is None or pttl == -2:
                continue
            key = (
                keys[i // 2].decode(errors="replace")
                if isinstance(keys[i // 2], bytes)
                else keys[i // 2]
            )
            try:
                data = json.loads(raw)
                why = self.verifier.why_refused(data)
                info = WorkerInfo.from_dict(data) if why is None else None
            except (ValueError, TypeError, AttributeError):
                why = "it is malformed"
            if why is not None:
                refused[key] = why
                continue
            expires = now + pttl / 1000 if pttl >= 0 else float("inf")
            entries[info.worker_id] = _Entry(info, expires)
        for key, why in refused.items():
            if self._refused.get(key) != why:
                logger.warning("registry: ignoring the entry %s: %s", key, why)
        self._refused = refused
        return entries

    @property
    def refused(self) -> dict[str, str]:
        """The entries the last refresh left out: {key: why} (unsigned, forged, replayed,
        malformed)."""
        return dict(self._refused)

    async def _poll_loop(self) -> None:
        while not self._closed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._poke.wait(), timeout=self.refresh_s)
            self._poke.clear()
            await self.refresh()

    async def _event_loop(self) -> None:
        """Apply ``down`` at once; an ``up`` makes the poll run now. Reconnects forever."""
        while not self._closed:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.events)
                while not self._closed:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None:
                        self._on_event(msg.get("data"))
            except redis_errors():
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(*redis_errors(), RuntimeError):
                    await pubsub.aclose()

    def _on_event(self, data) -> None:
        try:
            event = json.loads(data)
            kind, worker_id = event["kind"], event["id"]
        except (ValueError, TypeError, KeyError):
            return
        if kind == "down" and not self.verifier.verified(event):
            logger.warning("registry: ignoring an unsigned or forged 'down' for %s", worker_id)
            return
        if kind == "down":
            self._gone.append(worker_id)
            if self._entries.pop(worker_id, None) is not None:
                self.changed.set()
        self._poke.set()
