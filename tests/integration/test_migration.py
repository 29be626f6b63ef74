"""Streams that survive their decode worker, on real clusters (kvstore, prefill, two decode
workers, gateway; the tiny Llama in float32): SIGKILL or SIGSTOP the decode worker serving
live streams, disaggregated and colocated, and every stream finishes with the output of an
unbroken run (greedy and seeded), the migration counter equal to the streams cut; a dead
prefill worker costs a prefill on the decode worker instead."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.testing.cluster import Cluster, decode_idle, decode_stat
from pdserve.testing.metrics import metric
from tests.helpers.clusters import start_kvstore
from tests.helpers.flags import engine_flags

ENGINE = engine_flags(num_kv_blocks=512, max_num_seqs=16)
MODEL = "tiny"
IDLE_S = 2.0
NUM_STREAMS = 8
MAX_TOKENS = 400


def start_cluster(model_path, log_dir, disaggregated: bool, decode0_env=None) -> Cluster:
    c = Cluster(log_dir)
    model = ["--model", str(model_path)]
    try:
        known = start_kvstore(c)
        workers = c.start_many(
            ("decode-0", "pdserve.decode", *model, *ENGINE, *known, decode0_env or {}),
            ("decode-1", "pdserve.decode", *model, *ENGINE, *known),
            *([("prefill", "pdserve.prefill", *known, *model, *ENGINE)] if disaggregated else []),
        )
        pools = ["--prefill", workers[2].address] if disaggregated else ["--disaggregation", "off"]
        pools += ["--decode", workers[0].address, "--decode", workers[1].address]
        gw = c.start(
            "gateway",
            "pdserve.gateway",
            *pools,
            "--routing",
            "round-robin",
            "--stream-idle-timeout",
            str(IDLE_S),
            "--served-model-name",
            MODEL,
            *model,
        )
        c.url = f"http://{gw.addresses['gateway-http']}"
        return c
    except BaseException:
        c.stop_all()
        raise


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request, tiny_chat_llama_path, tmp_path_factory):
    """One cluster per mode for the module's tests, in order: stalls (the worker lives
    on), a kill (decode-0 is gone after it), a dead prefill worker (disaggregated)."""
    log_dir = tmp_path_factory.mktemp(f"migration-{request.param}")
    c = start_cluster(tiny_chat_llama_path, log_dir, request.param == "disaggregated")
    c.mode = request.param
    try:
        c.want, _ = asyncio.run(run_all(c.url))  # the unbroken run
        check_constrained_against_transformers(c.want, tiny_chat_llama_path)
        yield c
    finally:
        c.stop_all()


@pytest.fixture(scope="module")
def unmigrating(cluster, tiny_chat_llama_path):
    """A second gateway over the cluster's workers, with --migration-limit 0."""
    pools = [] if cluster.mode == "disaggregated" else ["--disaggregation", "off"]
    for s in cluster.services:
        if s.name == "prefill" or s.name.startswith("decode-"):
            pools += [f"--{s.name.split('-')[0]}", s.address]
    gw = cluster.start(
        "gateway-unmigrating",
        "pdserve.gateway",
        *pools,
        *("--routing", "round-robin", "--stream-idle-timeout", str(IDLE_S)),
        *("--migration-limit", "0", "--served-model-name", MODEL),
        *("--model", str(tiny_chat_llama_path)),
    )
    gw.url = f"http://{gw.addresses['gateway-http']}"
    return gw


def completions(url: str, n: int, max_tokens: int, at_once: bool) -> list[httpx.Response]:
    """Non-streamed completions of the first ``n`` bodies, together or one after another."""

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            calls = [
                client.post(
                    "/v1/completions",
                    json={**body(i), "stream": False, "max_tokens": max_tokens, "min_tokens": 0},
                )
                for i in range(n)
            ]
            if at_once:
                return await asyncio.gather(*calls)
            return [await call for call in calls]

    return asyncio.run(go())


# Streams 2 (greedy) and 5 (seeded) follow a grammar: their matcher is rebuilt from the
# tokens sent so far wherever they go. min_tokens keeps EOS out, so they run to max_tokens.
CONSTRAINED = {2, 5}
REGEX = "(the|quick|brown|fox|lazy|dog)( (the|quick|brown|fox|lazy|dog))*"


def prompt(i: int) -> list[int]:
    return [(5 * i + 7 * k) % 500 + 3 for k in range(20 + 3 * i)]


def body(i: int) -> dict:
    """Stream i: greedy for even i, seeded sampling for odd i; one asks for logprobs; the
    CONSTRAINED ones under REGEX."""
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": 100 + i}
    extra = {"logprobs": 2} if i == 3 else {}
    if i in CONSTRAINED:  # EOS held back by min_tokens (ignore_eos would let it through)
        extra = {"structured_outputs": {"regex": REGEX}, "min_tokens": MAX_TOKENS}
        extra["ignore_eos"] = False
    return {
        "model": MODEL,
        "prompt": prompt(i),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        **sampling,
        **extra,
    }


async def stream(client: httpx.AsyncClient, payload: dict, started: asyncio.Event | None):
    """(token ids, logprob count, finish reason) of a streamed completion; ``started`` is
    set once it has a few tokens."""
    tokens, num_logprobs, finish = [], 0, None
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            choice = event["choices"][0]
            tokens.extend(choice.get("token_ids") or [])
            num_logprobs += len((choice.get("logprobs") or {}).get("tokens") or [])
            finish = choice.get("finish_reason") or finish
            if started is not None and len(tokens) >= 3:
                started.set()
    return tokens, num_logprobs, finish


async def run_all(url: str, fault=None):
    """Every stream at once; ``fault()`` runs once each has begun, its result returned."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        started = [asyncio.Event() for _ in range(NUM_STREAMS)]
        tasks = [
            asyncio.create_task(stream(client, body(i), started[i])) for i in range(NUM_STREAMS)
        ]
        done = None
        if fault is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            done = await fault()
        return await asyncio.wait_for(asyncio.gather(*tasks), 180), done


def check_constrained_against_transformers(want, model_path) -> None:
    """The unbroken run's greedy constrained stream is transformers' under xgrammar's
    processor (disaggregated: its first token from the prefill worker), and every
    constrained stream's text follows REGEX."""
    import re

    from pdserve.core.sampling import StructuredOutputs
    from pdserve.testing.reference import compare, hf_greedy_structured

    (ref,) = hf_greedy_structured(
        model_path,
        [prompt(2)],
        MAX_TOKENS,
        StructuredOutputs(regex=REGEX),
        min_new_tokens=MAX_TOKENS,
    )
    assert compare(want[2][0], ref) is None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    for i in CONSTRAINED:
        text = tokenizer.decode(want[i][0])
        assert re.fullmatch(REGEX, text) or re.fullmatch(REGEX + " ?[a-z]*", text), text


async def in_flight(address: str) -> int:
    stat = await decode_stat(address)
    return stat.num_running + stat.num_waiting


def routable(url: str, within_s: float = 15.0) -> None:
    """Wait until the gateway routes to both decode workers (one it found unreachable or
    stalled sits out 5 s), so that a test's streams reach the one it harms."""
    deadline = time.monotonic() + within_s
    while metric(url, "pdserve:pool_workers", pool="decode") != 2:
        assert time.monotonic() < deadline, f"decode-0 not routable again within {within_s} s"
        time.sleep(0.1)


def check(got, want) -> None:
    for i, ((tokens, num_logprobs, finish), (w_tokens, _, _)) in enumerate(
        zip(got, want, strict=True)
    ):
        assert tokens == w_tokens, f"stream {i} differs from the unbroken run"
        assert finish == "length" and len(tokens) == MAX_TOKENS
        if i == 3:
            assert num_logprobs == len(tokens)


def test_a_stalled_decode_worker_is_left_after_the_idle_timeout(cluster):
    victim = next(s for s in cluster.services if s.name == "decode-0")

    async def stall() -> int:
        cut = await in_flight(victim.address)
        victim.proc.send_signal(signal.SIGSTOP)
        return cut

    try:
        got, cut = asyncio.run(run_all(cluster.url, stall))
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    check(got, cluster.want)
    assert cut >= 1
    assert metric(cluster.url, "pdserve:stream_migrations_total", reason="stalled") == cut
    # Woken, the stalled worker sees its streams cancelled and frees their blocks.
    asyncio.run(decode_idle(victim.address, 30, blocks_free=True))
    assert cluster.unhandled_errors() == []


def test_a_decode_worker_that_hangs_before_the_first_token_is_left(cluster):
    """Streams sent to a frozen worker: disaggregated, the client has the prefill's first
    token and the stream migrates; colocated, it has nothing yet and the call is retried on
    the other worker. Either way after the idle timeout, with the unbroken run's output."""
    routable(cluster.url)
    victim = next(s for s in cluster.services if s.name == "decode-0")
    gateway = next(s for s in cluster.services if s.name == "gateway")
    stalled = metric(cluster.url, "pdserve:stream_migrations_total", reason="stalled")
    retries = metric(cluster.url, "pdserve:worker_retries_total")
    sent_before = gateway.log_text().count(f"decode@{victim.address}")
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        got, _ = asyncio.run(run_all(cluster.url))
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    check(got, cluster.want)
    sent = gateway.log_text().count(f"decode@{victim.address}") - sent_before
    assert sent >= 1
    stalled = metric(cluster.url, "pdserve:stream_migrations_total", reason="stalled") - stalled
    retries = metric(cluster.url, "pdserve:worker_retries_total") - retries
    assert (stalled, retries) == ((sent, 0) if cluster.mode == "disaggregated" else (0, sent))
    asyncio.run(decode_idle(victim.address, 30, blocks_free=True))
    assert cluster.unhandled_errors() == []


def test_a_frozen_decode_worker_is_avoided_after_its_first_stalled_stream(cluster):
    """Requests one after another while decode-0 is frozen: the first sent there stalls
    and moves (or, colocated, is retried); the gateway then leaves decode-0 out (fixed
    addresses: for 5 s), so no other request waits out the idle timeout."""
    routable(cluster.url)
    victim = next(s for s in cluster.services if s.name == "decode-0")
    gateway = next(s for s in cluster.services if s.name == "gateway")
    sent_before = gateway.log_text().count(f"decode@{victim.address}")
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        responses = completions(cluster.url, 4, 8, at_once=False)
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    assert [r.status_code for r in responses] == [200] * 4
    assert gateway.log_text().count(f"decode@{victim.address}") - sent_before == 1
    asyncio.run(decode_idle(victim.address, 30, blocks_free=True))
    assert cluster.unhandled_errors() == []


def test_without_migration_a_stalled_stream_fails_with_a_clear_error(cluster, unmigrating):
    """--migration-limit 0: a stream that stalls after the client has the prefill's first
    token fails with 503 and the idle timeout named (colocated: it had no token yet and
    is retried on the other worker), never a 500 or an unhandled error."""
    routable(unmigrating.url)
    victim = next(s for s in cluster.services if s.name == "decode-0")
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        responses = completions(unmigrating.url, 4, 16, at_once=True)  # 2 to each worker
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    failed = [r.json()["error"]["message"] for r in responses if r.status_code != 200]
    if cluster.mode == "disaggregated":
        assert sorted(r.status_code for r in responses) == [200, 200, 503, 503], failed
        assert all("--stream-idle-timeout" in m for m in failed), failed
    else:
        assert failed == []
        assert metric(unmigrating.url, "pdserve:worker_retries_total") == 2
    asyncio.run(decode_idle(victim.address, 30, blocks_free=True))
    assert cluster.unhandled_errors() == []


def test_a_killed_decode_worker_loses_no_stream(cluster):
    routable(cluster.url)
    before = metric(cluster.url, "pdserve:stream_migrations_total")
    victim = next(s for s in cluster.services if s.name == "decode-0")
    survivor = next(s for s in cluster.services if s.name == "decode-1")
    gateway = next(s for s in cluster.services if s.name == "gateway")
    moved = rf"decode@{victim.address} -> decode@{survivor.address}"
    moved_before = len(re.findall(moved, gateway.log_text()))

    async def kill() -> int:
        cut = await in_flight(victim.address)
        await asyncio.to_thread(cluster.stop, victim, signal.SIGKILL)
        return cut

    got, cut = asyncio.run(run_all(cluster.url, kill))
    check(got, cluster.want)
    assert cut >= 1
    assert metric(cluster.url, "pdserve:stream_migrations_total") - before == cut
    assert metric(cluster.url, "pdserve:stream_migrations_total", reason="unavailable") == cut
    asyncio.run(decode_idle(survivor.address, 30, blocks_free=True))
    # Each request's log line says where it moved.
    assert len(re.findall(moved, gateway.log_text())) - moved_before == cut
    assert cluster.unhandled_errors() == []


def test_without_migration_a_dead_decode_worker_fails_one_request(cluster, unmigrating):
    """--migration-limit 0 and decode-0 is dead: the first request sent there fails
    (disaggregated: after the prefill's first token; colocated: it is retried), and the
    gateway routes the next ones to the live worker."""
    assert not next(s for s in cluster.services if s.name == "decode-0").alive()
    routable(unmigrating.url)  # it has not met the dead worker yet
    responses = completions(unmigrating.url, 6, 8, at_once=False)
    failed = sum(r.status_code != 200 for r in responses)
    assert failed == (1 if cluster.mode == "disaggregated" else 0)
    assert cluster.unhandled_errors() == []


def test_a_dead_prefill_worker_costs_a_prefill_on_the_decode_worker(cluster):
    if cluster.mode != "disaggregated":
        pytest.skip("no prefill worker in colocated mode")
    fallbacks = metric(cluster.url, "pdserve:prefill_requests_total", where="fallback")
    migrations = metric(cluster.url, "pdserve:stream_migrations_total")
    cluster.stop(next(s for s in cluster.services if s.name == "prefill"), signal.SIGKILL)
    got, _ = asyncio.run(run_all(cluster.url))
    check(got, cluster.want)
    fallbacks = metric(cluster.url, "pdserve:prefill_requests_total", where="fallback") - fallbacks
    assert fallbacks == NUM_STREAMS
    assert metric(cluster.url, "pdserve:stream_migrations_total") == migrations


def test_streams_leave_a_decode_worker_whose_engine_dies(tiny_chat_llama_path, tmp_path):
    """The watchdog answers the dead engine's streams UNAVAILABLE at once (and the worker
    exits 3); the gateway moves them. Outputs equal the in-process engine's."""
    llm = LLM(
        model=str(tiny_chat_llama_path), dtype="float32", num_kv_blocks=512, enforce_eager=True
    )
    from pdserve.core.sampling import StructuredOutputs

    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            ignore_eos=b["ignore_eos"],
            temperature=b["temperature"],
            seed=b.get("seed"),
            logprobs=b.get("logprobs"),
            min_tokens=b.get("min_tokens", 0),
            structured_outputs=StructuredOutputs(regex=REGEX) if i in CONSTRAINED else None,
        )
        for i, b in enumerate(map(body, range(NUM_STREAMS)))
    ]
    want = llm.generate([body(i)["prompt"] for i in range(NUM_STREAMS)], params)
    fault = {"PDSERVE_TEST_FAULT": "engine-thread-death-after:60"}
    c = start_cluster(tiny_chat_llama_path, tmp_path, disaggregated=True, decode0_env=fault)
    try:
        got, _ = asyncio.run(run_all(c.url))
        check(got, [(w.token_ids, None, None) for w in want])
        victim = next(s for s in c.services if s.name == "decode-0")
        assert victim.proc.wait(timeout=30) == 3
        gateway = next(s for s in c.services if s.name == "gateway").log_text()
        moved = len(re.findall(rf"decode@{victim.address} -> decode@", gateway))
        assert moved >= 1
        assert metric(c.url, "pdserve:stream_migrations_total", reason="unavailable") == moved
    finally:
        c.stop_all()
