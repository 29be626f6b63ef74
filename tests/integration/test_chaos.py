"""Faults without failed requests: a cluster of 2 prefill workers, 2 decode workers, 2
kvstore replicas, Redis and a gateway, each a real process (the tiny Llama, float32; KV
over NIXL where it is installed, the default --kv-transport auto),
serves a seeded load of greedy and sampled completions, streamed and not, 8 at a time,
while in turn the decode worker serving live streams is SIGKILLed, a decode worker is
SIGSTOPped past the stream idle timeout, a prefill worker, a kvstore replica and Redis are
SIGKILLed, and a prefill worker is SIGKILLed between its answer and the decode worker's
read of the blocks it staged, each started again as a supervisor would. The load goes on (its jobs again,
renamed) until the last fault is over. No request fails, every output is the fault-free
engine's, every decode worker ends with all its blocks free, and the gateway's migration
counter counts each stream the faults cut."""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import time
from asyncio import FIRST_COMPLETED
from collections import Counter

import pytest

from pdserve.testing.chaos import (
    FAULTS,
    HANDOVER_TOKENS,
    ChaosCluster,
    Load,
    decode_moves,
    make_jobs,
    reference_tokens,
    repeated,
    routes,
)
from pdserve.testing.metrics import metric
from pdserve.testing.reference import compare, hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "tiny"
CONCURRENCY = 8
NUM_JOBS = 64  # distinct jobs: each runs at least once
ROUNDS = 5  # at most: the load runs them again until the faults are over
LOAD_S = 150.0  # the deadline of the whole load
# Every engine step takes 30 ms longer (a real model's pace rather than the tiny one's),
# so that streams live for seconds, and the faults cut some.
WORKER_ENV = {"PDSERVE_TEST_FAULT": "engine-step-delay:0.03"}


@pytest.fixture(scope="module")
def jobs():
    return make_jobs(NUM_JOBS, seed=15, lengths=(48, 96, 144))


@pytest.fixture(scope="module")
def reference(tiny_llama_path, jobs):
    return reference_tokens(tiny_llama_path, jobs)


async def test_faults_fail_no_request(tiny_llama_path, tmp_path, jobs, reference):
    t0 = time.monotonic()
    async with ChaosCluster(tiny_llama_path, tmp_path, MODEL, worker_env=WORKER_ENV) as chaos:
        started_s = time.monotonic() - t0
        await chaos.idle(10)  # the starting count: every block free
        load = Load(chaos.url, MODEL, CONCURRENCY)
        async with load.running(repeated(jobs, ROUNDS)) as running:
            for kind in FAULTS:
                fault = asyncio.create_task(chaos.hit(kind))
                await asyncio.wait({fault, running}, timeout=120, return_when=FIRST_COMPLETED)
                if not fault.done():  # the load ended first (or the fault overran)
                    fault.cancel()
                    await asyncio.gather(fault, return_exceptions=True)
                    break
                fault.result()
            await asyncio.wait_for(every_job_taken(load, running), LOAD_S)
            load.stop.set()  # the clients end the requests they hold
            outcomes = await asyncio.wait_for(running, LOAD_S)
        await chaos.idle(30)
        log = chaos.gateway.log_text()
        migrations = {
            r: metric(chaos.url, "pdserve:stream_migrations_total", reason=r)
            for r in ("unavailable", "stalled", "error")
        }
        fallbacks = metric(chaos.url, "pdserve:prefill_requests_total", where="fallback")
        unhandled = chaos.cluster.unhandled_errors()

    failed = [f"{o.job.name}: {o.error}" for o in outcomes if o.error is not None]
    assert failed == [] and {o.job.base for o in outcomes} == {j.name for j in jobs}
    made = [f.kind for f in chaos.faults]
    assert made == list(FAULTS), f"the load ended after only {made}"
    for o in outcomes:
        assert o.tokens == reference[o.job.base], f"{o.job.name} differs from the fault-free run"
        assert o.finish == "length"

    # Every move left a decode worker a fault hit, and the counter counts each: the moves
    # out of the killed worker as "unavailable", those out of the frozen one as "stalled".
    by_victim = {f.kind: f.address for f in chaos.faults}
    seen = routes(log)
    assert set(seen) == {o.job.name for o in outcomes}
    moved_from = Counter(src for route in seen.values() for src, _ in decode_moves(route))
    assert set(moved_from) <= {by_victim["decode-kill"], by_victim["decode-stop"]}
    assert moved_from[by_victim["decode-kill"]] >= 1 and moved_from[by_victim["decode-stop"]] >= 1
    assert migrations == {
        "unavailable": moved_from[by_victim["decode-kill"]],
        "stalled": moved_from[by_victim["decode-stop"]],
        "error": 0,
    }
    # A prefill worker always answered (the other one, while one was down).
    assert fallbacks == 0
    # With NIXL installed the decode workers read KV over it (--kv-transport auto), and
    # the prefill kill above cut NIXL hand-overs too: none failed a request.
    assert chaos.reads_over_nixl() == (importlib.util.find_spec("nixl") is not None)
    # The prefill worker killed between its answer and the decode worker's read: that
    # request's tokens are transformers' all the same (the kvstore's copy, or recomputed).
    (handover,) = [f.handover for f in chaos.faults if f.kind == "prefill-kill-handover"]
    prompt, tokens = handover
    (ref,) = hf_greedy(tiny_llama_path, [prompt], HANDOVER_TOKENS)
    assert compare(tokens, ref) is None
    # Redis down: the gateway served from its last known registry.
    redis = next(f for f in chaos.faults if f.kind == "redis-kill")
    assert load.done_between(redis.at, redis.at + redis.recovered_s) >= 1
    assert unhandled == []

    print(
        f"\nchaos: cluster up in {started_s:.0f} s; {len(outcomes)} requests, 0 failed, "
        f"{sum(migrations.values()):g} migrations {migrations}; "
        + ", ".join(
            f"{f.kind} (load {f.load}) whole in {f.recovered_s:.1f} s" for f in chaos.faults
        )
    )


async def every_job_taken(load: Load, running: asyncio.Task) -> None:
    """Until each distinct job has been sent (or the load ended)."""
    while len(load.outcomes) + CONCURRENCY < NUM_JOBS and not running.done():
        await asyncio.sleep(0.2)


async def test_a_stream_goes_back_to_a_worker_it_left_once_that_is_back(tiny_llama_path, tmp_path):
    """Long streams on two decode workers A and B: A freezes, its streams move to B; A
    wakes and heartbeats again; B freezes: every stream moves to A, including those that
    left it, and each ends as an unbroken run would."""
    jobs = make_jobs(CONCURRENCY, seed=16, lengths=(600,))
    want = reference_tokens(tiny_llama_path, jobs)
    env = {"PDSERVE_TEST_FAULT": "engine-step-delay:0.02"}  # 600 tokens: over 12 s
    async with ChaosCluster(tiny_llama_path, tmp_path, MODEL, worker_env=env) as chaos:
        async with Load(chaos.url, MODEL, CONCURRENCY).running(jobs) as running:
            a, _ = await chaos.busiest_decode()
            (b,) = [c for c in chaos.workers("decode") if c is not a]
            for frozen, other in ((a, b), (b, a)):
                frozen.signal(signal.SIGSTOP)
                try:
                    await chaos.holds_all(other, CONCURRENCY)
                finally:
                    frozen.signal(signal.SIGCONT)
                await chaos.whole()
            outcomes = await asyncio.wait_for(running, LOAD_S)
        log = chaos.gateway.log_text()
    assert [o.error for o in outcomes] == [None] * CONCURRENCY
    assert all(o.tokens == want[o.job.name] for o in outcomes)
    there_and_back = [a.address, b.address, a.address]
    decodes = [[h[7:] for h in r if h.startswith("decode@")] for r in routes(log).values()]
    assert there_and_back in decodes
