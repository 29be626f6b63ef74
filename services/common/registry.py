"""The control plane in Redis: who serves, how loaded they are, and which blocks they hold.

Every prefill worker, decode worker and kvstore replica runs a ``RegistryPublisher``; every
gateway (and a prefill worker, to find the kvstore replicas) reads a ``RegistryView``.
Keys, under a prefix (``pdserve`` unless ``--redis-prefix`` says otherwise):

- ``P:worker:<id>``: the worker's ``WorkerInfo`` as JSON. It expires after the TTL unless
  the worker's heartbeat (several per TTL) renews it, so a worker that dies leaves the
  registry by itself. A graceful stop deletes it at once.
- ``P:blocks:<id>``: a set of the 16-byte block hashes the worker's prefix cache holds,
  kept current by the same heartbeat (stored and evicted hashes since the last one) and
  rewritten in full whenever the worker (re)registers, e.g. after a Redis restart.
- ``P:events``: a pub/sub channel; ``{"kind": "up"|"down", "id": ...}`` when a worker
  registers or leaves, so that views update at once instead of at their next poll.

A view polls all ``P:worker:*`` keys (with their remaining TTL) every ``refresh_s`` as
well, so a lost pub/sub message costs at most one poll. When Redis cannot be reached a
view keeps its last known entries (DESIGN: "Redis down: the gateway keeps its last known
registry"); a worker keeps serving and re-registers when Redis is back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "kvstore")
DEFAULT_PREFIX = "pdserve"
DEFAULT_TTL_S = 5.0
REDIS_ERRORS: tuple[type[BaseException], ...] = (OSError, asyncio.TimeoutError)


def _redis_errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.RedisError, *REDIS_ERRORS)


@dataclass
class WorkerInfo:
    """One registry entry: identity and capacity (fixed), load (renewed by each heartbeat)."""

    worker_id: str
    role: str
    address: str
    model: str = ""  # the served model's name (its directory's)
    fingerprint: str = ""  # hex model fingerprint: routes go only to matching workers
    block_size: int = 0
    num_total_blocks: int = 0
    max_num_seqs: int = 0
    capacity_bytes: int = 0  # kvstore
    # load
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    bytes_used: int = 0  # kvstore
    requests_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # bookkeeping
    seq: int = 0  # heartbeat count
    pid: int = 0
    started_at: float = 0.0
    updated_at: float = 0.0

    @property
    def active_blocks(self) -> int:
        """KV blocks held by running requests."""
        return max(self.num_total_blocks - self.num_free_blocks, 0)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerInfo:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def new_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Keys:
    """The registry's key names under one prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        self.events = f"{prefix}:events"
        self.worker_pattern = f"{prefix}:worker:*"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def blocks(self, worker_id: str) -> str:
        return f"{self.prefix}:blocks:{worker_id}"


def connect(url: str):
    """An asyncio Redis client with short timeouts: a dead Redis must never stall a request."""
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(
        url, socket_timeout=1.0, socket_connect_timeout=1.0, health_check_interval=5
    )


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
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"--registry-ttl must be positive, got {ttl_s}")
        self.info = info
        self.info.pid = os.getpid()
        self.info.started_at = time.time()
        self.ttl_s = ttl_s
        # Four beats per TTL, but at least 5 a second: routing reads the block sets.
        self.interval_s = min(ttl_s / 4, 0.2)
        self.keys = Keys(prefix)
        self._redis = connect(url)
        self._url = url
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
        except _redis_errors() as e:
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
            with contextlib.suppress(*_redis_errors()):
                await self._redis.publish(
                    self.keys.events, json.dumps({"kind": "up", "id": self.info.worker_id})
                )

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
        pipe.set(self.keys.worker(self.info.worker_id), self.info.to_json(), px=ttl_ms, get=True)
        if full:
            pipe.delete(blocks_key)
        if stored:
            pipe.sadd(blocks_key, *stored)
        if evicted:
            pipe.srem(blocks_key, *evicted)
        pipe.pexpire(blocks_key, ttl_ms)
        return (await pipe.execute())[0]

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
            pipe.publish(self.keys.events, json.dumps({"kind": "down", "id": worker_id}))
            await asyncio.wait_for(pipe.execute(), timeout=2.0)
        except _redis_errors() as e:
            logger.warning("registry: could not deregister %s (%s); its TTL will", worker_id, e)
        await self._redis.aclose()


@dataclass
class _Entry:
    info: WorkerInfo
    expires_at: float  # loop time at which Redis drops the key, as of the last poll


@dataclass
class RegistryView:
    """A live, local copy of the registry: entries whose TTL has not run out."""

    url: str
    prefix: str = DEFAULT_PREFIX
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

    def __post_init__(self) -> None:
        self.keys = Keys(self.prefix)
        self._redis = connect(self.url)
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
            with contextlib.suppress(asyncio.CancelledError, *_redis_errors()):
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
            return f"no {role} worker known: Redis at {self.url} is unreachable"
        return (
            f"no live {role} worker is registered in Redis at {self.url} (prefix "
            f"{self.prefix!r}): start one with `pdserve {role} --redis-url {self.url}`"
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
        except _redis_errors() as e:
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

    # --- following -----------------------------------------------------------------

    async def refresh(self) -> None:
        """Read every entry with its remaining TTL; keep the old view if Redis fails."""
        try:
            entries = await asyncio.wait_for(self._read_all(), timeout=max(self.refresh_s, 1.0))
        except _redis_errors() as e:
            if self.redis_ok:
                logger.warning(
                    "registry: Redis at %s is unreachable (%s); keeping the last known %d workers",
                    self.url,
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
        entries = {}
        for i in range(0, len(values), 2):
            raw, pttl = values[i], values[i + 1]
            if raw is None or pttl == -2:
                continue
            try:
                info = WorkerInfo.from_json(raw)
            except (ValueError, TypeError):
                logger.warning("registry: ignoring a malformed entry %r", keys[i // 2])
                continue
            expires = now + pttl / 1000 if pttl >= 0 else float("inf")
            entries[info.worker_id] = _Entry(info, expires)
        return entries

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
            except _redis_errors():
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(*_redis_errors(), RuntimeError):
                    await pubsub.aclose()

    def _on_event(self, data) -> None:
        try:
            event = json.loads(data)
            kind, worker_id = event["kind"], event["id"]
        except (ValueError, TypeError, KeyError):
            return
        if kind == "down":
            self._gone.append(worker_id)
            if self._entries.pop(worker_id, None) is not None:
                self.changed.set()
        self._poke.set()


def rendezvous_owner(key: bytes, replicas: Iterable[WorkerInfo]) -> WorkerInfo:
    """The replica that owns ``key`` by highest-random-weight (rendezvous) hashing: every
    process agrees given the same replicas, and adding a replica moves only the keys it
    now wins (about 1/n of them), all to itself."""
    import hashlib

    best, best_score = None, b""
    for replica in replicas:
        score = hashlib.blake2b(key + replica.worker_id.encode(), digest_size=8).digest()
        if best is None or score > best_score:
            best, best_score = replica, score
    if best is None:
        raise LookupError("no kvstore replica is registered")
    return best


def add_redis_args(parser, url_help: str) -> None:
    """``--redis-url`` (what it is for: ``url_help``) and ``--redis-prefix``."""
    from services.common.env import env_default

    parser.add_argument(
        "--redis-url",
        default=env_default("redis_url"),
        help=f"{url_help} (e.g. redis://127.0.0.1:6379/0) [env PDSERVE_REDIS_URL]",
    )
    parser.add_argument(
        "--redis-prefix",
        default=env_default("redis_prefix", DEFAULT_PREFIX),
        help="key prefix of the registry in Redis: clusters sharing one Redis use different ones",
    )


def add_registry_args(parser: argparse.ArgumentParser) -> None:
    """``--redis-url``, ``--redis-prefix``, ``--registry-ttl`` and ``--advertise-address``."""
    from services.common.env import env_default

    g = parser.add_argument_group("control plane")
    add_redis_args(g, "register in this Redis so gateways find this process; unset: no registry")
    g.add_argument(
        "--registry-ttl",
        type=float,
        default=env_default("registry_ttl", str(DEFAULT_TTL_S)),
        help="seconds a registry entry outlives the process's last heartbeat",
    )
    g.add_argument(
        "--advertise-address",
        default=env_default("advertise_address"),
        help="HOST:PORT others should dial (default: the bound host and port; set it when "
        "binding 0.0.0.0, e.g. to the pod IP)",
    )


def advertised(ns: argparse.Namespace, host: str, port: int) -> str:
    """The address to register: ``--advertise-address``, else ``host:port`` as bound."""
    if ns.advertise_address:
        return ns.advertise_address
    if host in ("0.0.0.0", "::", ""):
        return f"{socket.gethostname()}:{port}"
    return f"{host}:{port}"
