"""Which prefill and which decode worker serves a request.

The pools come from the Redis registry (``--redis-url``: workers join and leave by
themselves) or from fixed addresses (``--prefill``/``--decode``). Under the ``prefix``
policy (the default) each live candidate whose model matches the gateway's is scored

    cost(w) = prefix_weight * uncached_blocks(w) + load_weight * load_blocks(w)

- ``uncached_blocks``: the prompt's blocks minus the longest prefix of them that w's
  prefix cache holds (from the registry's block sets, or, sooner, from the prompts this
  gateway itself sent w in the last 10 s): the prefill work w would do. For a prefill
  worker, the blocks the kvstore replicas hold (their published block sets) count as
  held at ``FETCH_CREDIT``: the shared prefix tier fetches them rather than computing.
- ``load_blocks``: KV blocks in use on w: the larger of what w last reported and the
  blocks of this gateway's own requests in flight on w (reports are up to a heartbeat
  old; a burst of requests would otherwise all land on one worker).

The defaults (prefix_weight 1, load_weight 0.5) count a block in use at half a block to
prefill: a request in flight costs a worker less than recomputing its cached prefix would
(adding a sequence to a running batch is cheap; prefill is compute), so a family of
prompts stays on the worker that holds its prefix until that worker carries about two
requests more than the others. The lowest cost wins; ties go to the worker with fewer of this gateway's requests in
flight, then to the next in turn. A worker holding a hot prefix thus takes requests only
until its extra load outweighs the prefill it saves, so no one worker gets everything.
``round-robin`` ignores caches and load. Fixed-address pools have no block sets: there
only the prompts this gateway sent count as cached.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from pdserve.controlplane.registry import WorkerInfo
from pdserve.kv.hashing import prompt_block_hashes

POLICIES = ("prefix", "round-robin")


class NoWorkerError(RuntimeError):
    """A pool has no worker to route to."""


# A block a prefill worker can fetch from a kvstore counts as this much of one it holds:
# nearly (a fetch costs a copy, a compute a forward), so that a hot prefix in the kvstore
# spreads over the prefill pool by load, and a worker holding it still wins a tie.
FETCH_CREDIT = 0.9


@dataclass(frozen=True)
class RoutingPolicy:
    mode: str = "prefix"
    prefix_weight: float = 1.0
    load_weight: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(POLICIES)}, got {self.mode!r}")
        if self.prefix_weight < 0 or self.load_weight < 0:
            raise ValueError("--route-prefix-weight and --route-load-weight must be 0 or more")


@dataclass(frozen=True)
class Route:
    """A chosen worker and how much of the prompt its prefix cache already holds."""

    worker: WorkerInfo
    cached_tokens: int = 0
    blocks: int = 0  # the prompt's KV blocks on this worker, for in-flight accounting

    @property
    def address(self) -> str:
        return self.worker.address


class StaticPools:
    """Fixed worker addresses; a worker found unreachable sits out ``retry_after_s``."""

    def __init__(
        self,
        prefill_addrs: Sequence[str],
        decode_addrs: Sequence[str],
        retry_after_s: float = 5.0,
    ) -> None:
        self._workers = [WorkerInfo(a, "prefill", a) for a in prefill_addrs] + [
            WorkerInfo(a, "decode", a) for a in decode_addrs
        ]
        self.retry_after_s = retry_after_s
        self._unreachable: dict[str, float] = {}

    def workers(self, role: str | None = None) -> list[WorkerInfo]:
        now = time.monotonic()
        return [
            w
            for w in self._workers
            if (role is None or w.role == role) and self._unreachable.get(w.worker_id, 0) <= now
        ]

    def mark_unreachable(self, worker_id: str) -> None:
        self._unreachable[worker_id] = time.monotonic() + self.retry_after_s

    async def prefix_lengths(self, workers, hashes) -> dict[str, int]:
        return {}

    async def fetchable_prefix(self, hashes) -> int:
        return 0

    def describe(self, role: str) -> str:
        return f"no {role} worker: start one and pass its address with --{role}"


def score(
    prompt_len: int,
    worker: WorkerInfo,
    cached_blocks: int,
    inflight_blocks: int,
    policy: RoutingPolicy,
) -> float:
    """The cost of sending the prompt to ``worker`` (see the module docstring)."""
    block_size = worker.block_size or 16
    uncached = max(math.ceil(prompt_len / block_size) - cached_blocks, 0)
    load = max(worker.active_blocks, inflight_blocks)
    return policy.prefix_weight * uncached + policy.load_weight * load


class Router:
    """Picks workers by the policy and keeps the accounting the scores need."""

    def __init__(
        self,
        pools,
        policy: RoutingPolicy | None = None,
        fingerprint: bytes | None = None,
    ) -> None:
        self.pools = pools
        self.policy = policy or RoutingPolicy()
        self.fingerprint = fingerprint
        # One rotation per pool: a request that picks a decode and a prefill worker must
        # not make each pool skip every other worker.
        self._turns: defaultdict[str, Iterator[int]] = defaultdict(itertools.count)
        self._inflight_blocks: Counter[str] = Counter()
        self._inflight_requests: Counter[str] = Counter()
        self.routed: Counter[tuple[str, str]] = Counter()  # (role, worker id) -> requests
        self._sent = SentBlocks()

    def candidates(self, role: str, exclude: frozenset[str] = frozenset()) -> list[WorkerInfo]:
        """Live workers of the pool that serve the gateway's model; NoWorkerError if none.

        With a fingerprint (the registry's pools) an entry must name the same one: one
        without is refused, as an entry only a writer to Redis made could be."""
        live = [w for w in self.pools.workers(role) if w.worker_id not in exclude]
        ours = self.fingerprint.hex() if self.fingerprint else ""
        matching = [w for w in live if not ours or w.fingerprint == ours]
        if matching:
            return matching
        if live:
            raise NoWorkerError(
                f"{len(live)} {role} worker(s) are registered, but none serves this gateway's "
                "model (their model fingerprint differs or is missing): start them with the "
                "same --model"
            )
        raise NoWorkerError(self.pools.describe(role))

    async def pick(
        self, role: str, prompt: Sequence[int], exclude: frozenset[str] = frozenset()
    ) -> Route:
        """The worker of ``role`` to send ``prompt`` to."""
        workers = self.candidates(role, exclude)
        turn = next(self._turns[role])
        if self.policy.mode == "round-robin":
            return self._route(role, workers[turn % len(workers)], prompt, 0)
        hashes = _hashes_by_block_size(prompt, self.fingerprint)
        cached = await self.pools.prefix_lengths(workers, hashes) if self.fingerprint else {}
        for w in workers:  # what this gateway sent lately, not yet in the registry
            sent = self._sent.prefix_length(w.worker_id, hashes(w.block_size or 16))
            cached[w.worker_id] = max(cached.get(w.worker_id, 0), sent)
        # A prefill worker fetches from the kvstores (the shared prefix tier) what its own
        # cache lacks: those blocks count for it too, at FETCH_CREDIT of a held one.
        fetchable = 0
        if role == "prefill" and self.fingerprint:
            fetchable = await self.pools.fetchable_prefix(hashes(workers[0].block_size or 16))
        n = len(workers)

        def key(i: int) -> tuple[float, int, int]:
            w = workers[i]
            held = cached.get(w.worker_id, 0)
            cost = score(
                len(prompt),
                w,
                held + FETCH_CREDIT * max(fetchable - held, 0),
                self._inflight_blocks[w.worker_id],
                self.policy,
            )
            return cost, self._inflight_requests[w.worker_id], (i - turn) % n

        best = workers[min(range(n), key=key)]
        self._sent.remember(best.worker_id, hashes(best.block_size or 16))
        return self._route(role, best, prompt, cached.get(best.worker_id, 0))

    def _route(self, role: str, worker: WorkerInfo, prompt: Sequence[int], cached: int) -> Route:
        self.routed[(role, worker.worker_id)] += 1
        block_size = worker.block_size or 16
        return Route(
            worker,
            cached_tokens=min(cached * block_size, len(prompt)),
            blocks=math.ceil(len(prompt) / block_size),
        )

    @contextlib.contextmanager
    def track(self, route: Route) -> Iterator[None]:
        """Count the request as in flight on the route's worker while inside."""
        worker_id = route.worker.worker_id
        self._inflight_blocks[worker_id] += route.blocks
        self._inflight_requests[worker_id] += 1
        try:
            yield
        finally:
            self._inflight_blocks[worker_id] -= route.blocks
            self._inflight_requests[worker_id] -= 1

    def mark_unreachable(self, route: Route) -> None:
        self.pools.mark_unreachable(route.worker.worker_id)


class SentBlocks:
    """Block hashes of prompts this gateway sent to each worker in the last ``ttl_s``.

    A worker publishes the blocks it computed a heartbeat or two after computing them;
    a family of prompts arriving faster than that would otherwise scatter before the
    first one's blocks show up in the registry. Bounded per worker, oldest out first.
    """

    def __init__(self, ttl_s: float = 10.0, max_per_worker: int = 1 << 16) -> None:
        self.ttl_s = ttl_s
        self.max_per_worker = max_per_worker
        self._sent: dict[str, OrderedDict[bytes, float]] = {}

    def remember(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        sent = self._sent.setdefault(worker_id, OrderedDict())
        until = time.monotonic() + self.ttl_s
        for h in hashes:
            sent[h] = until
            sent.move_to_end(h)
        while len(sent) > self.max_per_worker:
            sent.popitem(last=False)

    def prefix_length(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        sent = self._sent.get(worker_id)
        if not sent:
            return 0
        now = time.monotonic()
        n = 0
        for h in hashes:
            if sent.get(h, 0.0) <= now:
                break
            n += 1
        return n


def _hashes_by_block_size(
    prompt: Sequence[int], fingerprint: bytes | None
) -> Callable[[int], Sequence[bytes]]:
    """The prompt's full-block hashes for a block size, computed once per size."""
    memo: dict[int, list[bytes]] = {}

    def hashes(block_size: int) -> Sequence[bytes]:
        if block_size not in memo:
            memo[block_size] = prompt_block_hashes(prompt, block_size, fingerprint or b"")
        return memo[block_size]

    return hashes
