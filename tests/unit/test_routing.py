"""The router's arithmetic and the kvstore placement: scores, ties, spreading, rendezvous."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pdserve.controlplane.registry import WorkerInfo, rendezvous_owner
from pdserve.gateway.router import (
    NoWorkerError,
    Router,
    RoutingPolicy,
    StaticPools,
    score,
)
from pdserve.kv.hashing import hash_block, prompt_block_hashes

FP = b"f" * 16
FP_HEX = FP.hex()


def test_prompt_block_hashes_chain_full_blocks_only():
    tokens = list(range(10))
    hashes = prompt_block_hashes(tokens, 4, FP)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(None, tokens[:4], FP)
    assert hashes[1] == hash_block(hashes[0], tokens[4:8], FP)
    assert prompt_block_hashes(tokens[:3], 4, FP) == []


def test_score_weighs_uncached_blocks_against_load():
    w = WorkerInfo("w", "decode", "a:1", block_size=16, num_total_blocks=100, num_free_blocks=90)
    policy = RoutingPolicy(load_weight=1.0)
    # 100 tokens = 7 blocks, 4 cached -> 3 uncached; 10 blocks in use.
    assert score(100, w, 4, 0, policy) == 3 + 10
    # The gateway's own in-flight count wins when the worker's report is behind.
    assert score(100, w, 4, 25, policy) == 3 + 25
    assert score(100, w, 4, 0, RoutingPolicy()) == 3 + 0.5 * 10  # the defaults
    assert score(100, w, 4, 0, RoutingPolicy(prefix_weight=2.0, load_weight=0.5)) == 6 + 5


def test_policy_and_pool_errors_are_clear():
    with pytest.raises(ValueError, match="--routing"):
        RoutingPolicy("random")
    with pytest.raises(ValueError, match="weight"):
        RoutingPolicy(load_weight=-1)


class Pools:
    """Registry-shaped pools with fixed prefix lengths: the router's inputs, nothing else."""

    def __init__(self, workers, cached, fetchable=0):
        self._workers, self.cached, self.fetchable = workers, cached, fetchable
        self.unreachable: set[str] = set()

    async def fetchable_prefix(self, hashes):
        return min(self.fetchable, len(hashes))

    def workers(self, role=None):
        return [w for w in self._workers if w.role == role and w.worker_id not in self.unreachable]

    def mark_unreachable(self, worker_id):
        self.unreachable.add(worker_id)

    async def prefix_lengths(self, workers, hashes):
        return {w.worker_id: self.cached.get(w.worker_id, 0) for w in workers}

    def describe(self, role):
        return f"no {role} worker"


def decode(worker_id, fingerprint=FP_HEX):
    return WorkerInfo(worker_id, "decode", f"{worker_id}:1", fingerprint=fingerprint, block_size=16)


async def test_the_longest_cached_prefix_wins_until_its_load_outweighs_it():
    pools = Pools([decode("a"), decode("b")], {"a": 6})
    router = Router(pools, fingerprint=FP)
    prompt = list(range(128))  # 8 blocks; a holds 6 of them
    route = await router.pick("decode", prompt)
    assert route.worker.worker_id == "a" and route.cached_tokens == 96
    # Each request in flight on a counts its 8 blocks: the saving of 6 blocks is gone
    # after one, so the hot prefix spreads to b.
    picks, in_flight = [], []
    for _ in range(6):
        route = await router.pick("decode", prompt)
        picks.append(route.worker.worker_id)
        in_flight.append(router.track(route))
        in_flight[-1].__enter__()  # stays in flight
    assert set(picks) == {"a", "b"}
    assert max(Counter(picks).values()) <= 4


async def test_prefill_workers_are_credited_what_the_kvstores_hold():
    """A prefix the kvstores hold is fetched, not computed, by any prefill worker: the one
    holding it no longer wins against a less loaded one (decode workers get no credit)."""
    prefill = [
        WorkerInfo(w, "prefill", f"{w}:1", fingerprint=FP_HEX, block_size=16, num_total_blocks=64)
        for w in ("p", "q")
    ]
    prefill[0].num_free_blocks = 56  # p holds the prefix and carries 8 blocks of load
    prefill[1].num_free_blocks = 64
    prompt = list(range(128))  # 8 blocks
    cold = Router(Pools(prefill, {"p": 7}), fingerprint=FP)
    assert (await cold.pick("prefill", prompt)).worker.worker_id == "p"
    warm = Router(Pools(prefill, {"p": 7}, fetchable=7), fingerprint=FP)
    route = await warm.pick("prefill", prompt)
    assert route.worker.worker_id == "q" and route.cached_tokens == 0  # it holds none itself
    # Unloaded, the holder still wins the tie the credit leaves (a fresh router: this one
    # now counts the prompt as sent to q).
    prefill[0].num_free_blocks = 64
    warm = Router(Pools(prefill, {"p": 7}, fetchable=7), fingerprint=FP)
    assert (await warm.pick("prefill", prompt)).worker.worker_id == "p"
    decoders = Router(Pools([decode("a"), decode("b")], {"a": 7}, fetchable=7), fingerprint=FP)
    assert (await decoders.pick("decode", prompt)).worker.worker_id == "a"


async def test_ties_rotate_and_round_robin_ignores_caches():
    pools = Pools([decode("a"), decode("b"), decode("c")], {})
    router = Router(pools, fingerprint=FP)
    picks = [(await router.pick("decode", [1, 2, 3])).worker.worker_id for _ in range(6)]
    assert Counter(picks) == {"a": 2, "b": 2, "c": 2}
    rr = Router(Pools([decode("a"), decode("b")], {"a": 8}), RoutingPolicy("round-robin"), FP)
    picks = [(await rr.pick("decode", list(range(128)))).worker.worker_id for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]


async def test_each_pool_takes_its_turns_apart():
    """A disaggregated request picks a decode and a prefill worker: each pool rotates on
    its own, so two decode workers both get requests."""
    prefill = [WorkerInfo(w, "prefill", f"{w}:1", fingerprint=FP_HEX) for w in ("p", "q")]
    for policy in (RoutingPolicy("round-robin"), RoutingPolicy()):
        router = Router(Pools([decode("a"), decode("b"), *prefill], {}), policy, FP)
        picks = []
        for _ in range(4):
            picks.append((await router.pick("decode", [1, 2, 3])).worker.worker_id)
            picks.append((await router.pick("prefill", [1, 2, 3])).worker.worker_id)
        assert picks == ["a", "p", "b", "q", "a", "p", "b", "q"], policy


async def test_only_workers_of_the_same_model_are_candidates():
    pools = Pools([decode("a", fingerprint="00" * 16), decode("b")], {})
    router = Router(pools, fingerprint=FP)
    assert {(await router.pick("decode", [1])).worker.worker_id for _ in range(4)} == {"b"}
    lone = Router(Pools([decode("a", fingerprint="00" * 16)], {}), fingerprint=FP)
    with pytest.raises(NoWorkerError, match="same --model"):
        await lone.pick("decode", [1])
    with pytest.raises(NoWorkerError, match="no prefill worker"):
        await lone.pick("prefill", [1])


async def test_static_pools_skip_an_unreachable_address_for_a_while():
    pools = StaticPools(["p1"], ["d1", "d2"], retry_after_s=60)
    router = Router(pools)
    route = await router.pick("decode", [1])
    router.mark_unreachable(route)
    others = {(await router.pick("decode", [1])).address for _ in range(3)}
    assert others == {"d1", "d2"} - {route.address}


def replicas(n):
    return [WorkerInfo(f"kv-{i}", "kvstore", f"127.0.0.1:{7000 + i}") for i in range(n)]


def test_rendezvous_spreads_keys_and_adding_a_replica_moves_only_its_share():
    rng = random.Random(0)
    keys = [rng.randbytes(16) for _ in range(4000)]
    before = {k: rendezvous_owner(k, replicas(3)).worker_id for k in keys}
    counts = Counter(before.values())
    assert all(1100 < c < 1570 for c in counts.values()), counts  # about 1/3 each
    after = {k: rendezvous_owner(k, replicas(4)).worker_id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "kv-3" for k in moved)  # only to the new replica
    assert 800 < len(moved) < 1200  # about 1/4 of the keys
    # Order of the replica list does not matter: every process agrees.
    shuffled = replicas(4)
    rng.shuffle(shuffled)
    assert all(rendezvous_owner(k, shuffled).worker_id == after[k] for k in keys[:200])
    with pytest.raises(LookupError, match="no kvstore"):
        rendezvous_owner(keys[0], [])


async def test_prompts_sent_lately_count_before_the_registry_shows_them():
    pools = Pools([decode("a"), decode("b")], {})  # the registry knows of no block yet
    router = Router(pools, fingerprint=FP)
    family = list(range(128))
    picks = {(await router.pick("decode", family + [500 + i])).worker.worker_id for i in range(4)}
    assert len(picks) == 1  # the family stays where its first prompt went
    rr = Router(Pools([decode("a"), decode("b")], {}), RoutingPolicy("round-robin"), FP)
    picks = {(await rr.pick("decode", family + [500 + i])).worker.worker_id for i in range(4)}
    assert picks == {"a", "b"}


def test_sent_blocks_expire_and_stay_bounded():
    from pdserve.gateway.router import SentBlocks

    sent = SentBlocks(ttl_s=60, max_per_worker=3)
    sent.remember("w", [b"a", b"b", b"c", b"d"])
    assert sent.prefix_length("w", [b"a"]) == 0  # the oldest went out
    assert sent.prefix_length("w", [b"b", b"c", b"d", b"e"]) == 3
    gone = SentBlocks(ttl_s=-1)
    gone.remember("w", [b"a"])
    assert gone.prefix_length("w", [b"a"]) == 0
