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
view keeps its last known entries, so the gateway routes on while Redis is down; a worker
keeps serving and re-registers when Redis is back (docs/faults.md, "Redis").
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.controlplane.signing import signed_json
from pdserve.settings.process import host_port
from pdserve.settings.redis_url import is_sentinel, parse_sentinel_url

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "kvstore")
DEFAULT_PREFIX = "pdserve"
DEFAULT_TTL_S = 5.0
REDIS_ERRORS: tuple[type[BaseException], ...] = (OSError, asyncio.TimeoutError)


def redis_errors() -> tuple[type[BaseException], ...]:
    """What a Redis call raises when Redis is down or slow."""
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
    # Processes one engine's model is split over; older entries, without it, read as 1.
    tensor_parallel_size: int = 1
    capacity_bytes: int = 0  # kvstore
    metrics_address: str = ""  # HOST:PORT of its Prometheus /metrics ("" when off)
    # --kv-transport nixl: its NIXL agent's name and metadata (base64); "": KV over gRPC.
    # A decode worker reads blocks only from agents whose metadata a signed entry gave.
    nixl_agent: str = ""
    nixl_metadata: str = ""
    # load
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    bytes_used: int = 0  # kvstore
    requests_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_num_drafts: int = 0  # speculative decoding: verifications with proposals
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # bookkeeping
    seq: int = 0  # heartbeat count
    pid: int = 0
    started_at: float = 0.0
    updated_at: float = 0.0

    @property
    def active_blocks(self) -> int:
        """KV blocks held by running requests."""
        return max(self.num_total_blocks - self.num_free_blocks, 0)

    def to_json(self, key: bytes | None = None) -> str:
        """The entry as Redis holds it, signed under ``key`` (``signing``; None: not)."""
        return signed_json(dataclasses.asdict(self), key)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerInfo:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> WorkerInfo:
        """The entry's known fields (a newer writer's extra ones, and the signature, aside)."""
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
    """An asyncio Redis client with short timeouts: a dead Redis must never stall a request.
    A ``redis+sentinel://`` URL gives a client of the master the Sentinels name, which asks
    them again when the master fails over (pdserve.settings.redis_url)."""
    import redis.asyncio as aioredis

    timeouts = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
    if not is_sentinel(url):
        return aioredis.Redis.from_url(url, health_check_interval=5, **timeouts)
    from redis.asyncio.sentinel import Sentinel

    spec = parse_sentinel_url(url)
    tls = {"ssl": True} if spec.tls else {}
    sentinels = Sentinel(
        list(spec.sentinels),
        sentinel_kwargs={"password": spec.sentinel_password, **timeouts, **tls},
        **timeouts,
        **tls,
    )
    return sentinels.master_for(
        spec.service,
        db=spec.db,
        username=spec.username,
        password=spec.password,
        health_check_interval=5,
    )


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


def advertised_address(advertise_address: str | None, host: str, port: int) -> str:
    """The address to register: ``--advertise-address``, else ``host:port`` as bound. An
    IPv6 host comes out in brackets, as gRPC dials it, also when given without (as
    ``$(POD_IP):PORT`` is on an IPv6 Kubernetes cluster)."""
    if advertise_address:
        host, _, advertised_port = advertise_address.rpartition(":")
        return host_port(host.strip("[]"), int(advertised_port))
    if host in ("0.0.0.0", "::", ""):
        return f"{socket.gethostname()}:{port}"
    return host_port(host, port)
