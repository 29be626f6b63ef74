"""The Redis registry against a real Redis-compatible server: publishers and views in one
process, the server restarted and killed under them."""

from __future__ import annotations

import asyncio
import signal

from pdserve.controlplane.publisher import RegistryPublisher
from pdserve.controlplane.registry import WorkerInfo
from pdserve.controlplane.view import RegistryView

TTL_S = 1.5
WAIT_S = 10.0


class FakeCache:
    """Block events as an engine would produce them (the real engine is tested elsewhere)."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.stored: list[bytes] = []
        self.evicted: list[bytes] = []

    def store(self, *hashes: bytes) -> None:
        self.held.update(hashes)
        self.stored.extend(hashes)

    def evict(self, *hashes: bytes) -> None:
        self.held.difference_update(hashes)
        self.evicted.extend(hashes)

    async def drain(self, full: bool):
        stored, evicted = self.stored, self.evicted
        self.stored, self.evicted = [], []
        return (sorted(self.held), []) if full else (stored, evicted)


def worker(name: str, role: str = "decode", block_size: int = 4) -> WorkerInfo:
    return WorkerInfo(name, role, f"127.0.0.1:{1000 + len(name)}", block_size=block_size)


async def until(predicate, timeout: float = WAIT_S) -> float:
    """Seconds until ``predicate()`` holds; fails the test past ``timeout``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        if loop.time() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.02)
    return loop.time() - start


def ids(view: RegistryView, role: str | None = None) -> set[str]:
    return {w.worker_id for w in view.workers(role)}


H = [bytes([i]) * 16 for i in range(8)]


async def test_workers_join_report_load_and_leave(redis_server):
    view = RegistryView(redis_server.url, prefix="t1", refresh_s=0.2)
    other_view = RegistryView(redis_server.url, prefix="t1", refresh_s=0.2)
    await view.start()
    await other_view.start()
    load = {"num_running": 3}

    async def report():
        return dict(load)

    pubs = [
        RegistryPublisher(redis_server.url, worker("d0"), report, ttl_s=TTL_S, prefix="t1"),
        RegistryPublisher(redis_server.url, worker("p0", "prefill"), ttl_s=TTL_S, prefix="t1"),
        RegistryPublisher(redis_server.url, worker("k0", "kvstore"), ttl_s=TTL_S, prefix="t2"),
    ]
    try:
        for pub in pubs:
            await pub.start()
        await until(lambda: ids(view) == {"d0", "p0"})  # another prefix is another cluster
        await until(lambda: ids(other_view) == {"d0", "p0"})  # every gateway sees the pools
        assert ids(view, "decode") == {"d0"}
        assert view.workers("decode")[0].num_running == 3
        load["num_running"] = 5
        await until(lambda: view.workers("decode")[0].num_running == 5)

        # A graceful stop: gone from the view at once (the "down" event), not after the TTL.
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await pubs[0].stop()
        await until(lambda: "d0" not in ids(view))
        assert loop.time() - t0 < TTL_S / 2
    finally:
        for pub in pubs:
            await pub.stop()
        await view.close()
        await other_view.close()


async def test_a_worker_that_stops_beating_leaves_within_the_ttl(redis_server):
    view = RegistryView(redis_server.url, refresh_s=0.5)
    await view.start()
    pub = RegistryPublisher(redis_server.url, worker("d1"), ttl_s=TTL_S)
    await pub.start()
    try:
        await until(lambda: ids(view) == {"d1"})
        # As if SIGKILLed: the heartbeat task dies, nothing deregisters.
        pub._task.cancel()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await until(lambda: ids(view) == set())
        assert loop.time() - t0 <= TTL_S + 0.1
    finally:
        await pub.stop()
        await view.close()


async def test_prefix_lengths_follow_stored_and_evicted_blocks(redis_server):
    view = RegistryView(redis_server.url, refresh_s=0.2)
    await view.start()
    caches = {"a": FakeCache(), "b": FakeCache()}
    pubs = [
        RegistryPublisher(redis_server.url, worker(n), blocks=c.drain, ttl_s=TTL_S)
        for n, c in caches.items()
    ]
    try:
        for pub in pubs:
            await pub.start()
        await until(lambda: ids(view) == {"a", "b"})
        caches["a"].store(H[0], H[1], H[2])
        caches["b"].store(H[0], H[5])

        async def lengths(prompt_hashes):
            return await view.prefix_lengths(view.workers(), lambda bs: prompt_hashes)

        async def settled(expected, prompt_hashes):
            for _ in range(int(WAIT_S / 0.05)):
                if await lengths(prompt_hashes) == expected:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"{await lengths(prompt_hashes)} != {expected}")

        await settled({"a": 3, "b": 1}, [H[0], H[1], H[2], H[3]])
        await settled({"a": 1, "b": 0}, [H[1], H[5]])  # a held block after a miss: no prefix
        caches["a"].evict(H[1])
        await settled({"a": 1, "b": 1}, [H[0], H[1], H[2]])
    finally:
        for pub in pubs:
            await pub.stop()
        await view.close()


async def test_redis_lost_and_back(redis_server):
    """While Redis is gone the view keeps its last known workers and publishers keep
    trying; when Redis returns (empty: a restart) the entries and block sets come back."""
    view = RegistryView(redis_server.url, refresh_s=0.2)
    await view.start()
    cache = FakeCache()
    cache.store(H[0], H[1])
    pub = RegistryPublisher(redis_server.url, worker("d2"), blocks=cache.drain, ttl_s=TTL_S)
    await pub.start()
    try:
        await until(lambda: ids(view) == {"d2"})
        redis_server.child.signal(signal.SIGKILL)
        redis_server.child.proc.wait(5)
        await until(lambda: not view.redis_ok)
        await asyncio.sleep(TTL_S * 2)  # well past the TTL
        assert ids(view) == {"d2"}  # the last known registry
        cache.store(H[2])  # stored while Redis is away: not lost
        redis_server.restart()
        await until(lambda: view.redis_ok and ids(view) == {"d2"})
        got = await view.prefix_lengths(view.workers(), lambda bs: [H[0], H[1], H[2]])
        for _ in range(50):
            if got == {"d2": 3}:
                break
            await asyncio.sleep(0.1)
            got = await view.prefix_lengths(view.workers(), lambda bs: [H[0], H[1], H[2]])
        assert got == {"d2": 3}
    finally:
        await pub.stop()
        await view.close()


async def test_unreachable_workers_sit_out_until_they_beat_again(redis_server):
    view = RegistryView(redis_server.url, refresh_s=0.1)
    await view.start()
    pub = RegistryPublisher(redis_server.url, worker("d3"), ttl_s=TTL_S)
    await pub.start()
    try:
        await until(lambda: ids(view) == {"d3"})
        view.mark_unreachable("d3")
        assert ids(view) == set()
        await until(lambda: ids(view) == {"d3"})  # two fresh heartbeats later
    finally:
        await pub.stop()
        await view.close()
