"""A worker whose engine dies or stalls leaves: its requests end with UNAVAILABLE, its
health turns NOT_SERVING, it deregisters and exits 3. Real workers (faults injected with the
test-only PDSERVE_TEST_FAULT), real gRPC, a real Redis-compatible server."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.runtime.rpc import aio_channel
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.helpers.flags import engine_flags

ENGINE = engine_flags(num_kv_blocks=64, max_model_len=256)
# Far longer than the test: an entry that disappears was deregistered, not expired.
TTL = ["--registry-ttl", "60"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _worker(cluster, role, model, redis_server, fault, *args):
    return cluster.start(
        role,
        f"pdserve.{role}",
        "--model", str(model), *ENGINE, "--redis-url", redis_server.url, "--redis-prefix", role,
        *TTL, *args,
        env={"PDSERVE_TEST_FAULT": fault},
    )  # fmt: skip


def _entries(client: redis.Redis, prefix: str) -> list[dict]:
    return [json.loads(client.get(k)) for k in client.keys(f"{prefix}:worker:*")]


async def _statuses(address: str) -> list[int]:
    """The overall health the server reports, from now until its Watch stream ends."""
    seen = []
    async with aio_channel(address) as ch:
        try:
            async for reply in health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=60
            ):
                seen.append(reply.status)
        except grpc.aio.AioRpcError:
            pass  # the server went away
    return seen


async def _decode(address: str, max_tokens: int) -> tuple[list[int], grpc.aio.AioRpcError | None]:
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    request = decode_pb2.DecodeRequest(
        request_id="r1", prompt_token_ids=list(range(5, 40)), params=params
    )
    tokens = []
    async with aio_channel(address) as ch:
        try:
            async for out in decode_pb2_grpc.DecodeStub(ch).Decode(request, timeout=60):
                tokens.extend(out.token_ids)
        except grpc.aio.AioRpcError as error:
            return tokens, error
    return tokens, None


async def _fail_and_watch(address: str, call) -> tuple[list[int], grpc.aio.AioRpcError | None]:
    """Health statuses seen while ``call`` runs and the worker leaves; ``call``'s error."""
    watch = asyncio.create_task(_statuses(address))
    await asyncio.sleep(0.2)  # the Watch stream has its first reply
    error = await call
    statuses = await asyncio.wait_for(watch, timeout=60)
    return statuses, error


def test_engine_thread_death_fails_requests_deregisters_and_exits_3(
    cluster, redis_server, tiny_llama_path
):
    worker = _worker(
        cluster, "decode", tiny_llama_path, redis_server, "engine-thread-death-after:3"
    )
    client = redis.Redis.from_url(redis_server.url)
    events = client.pubsub()
    events.subscribe("decode:events")
    (entry,) = _entries(client, "decode")
    assert entry["pid"] == worker.pid

    async def call():
        tokens, error = await _decode(worker.address, max_tokens=32)
        assert 0 < len(tokens) < 32  # a few steps ran before the thread died
        return error

    statuses, error = asyncio.run(_fail_and_watch(worker.address, call()))
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "engine" in error.details() and "retry on another worker" in error.details()
    assert statuses[0] == SERVING and NOT_SERVING in statuses

    assert worker.proc.wait(timeout=30) == 3
    assert _entries(client, "decode") == []  # deleted, long before its TTL
    downs = []
    for _ in range(50):
        message = events.get_message(timeout=0.1)
        if message and message["type"] == "message":
            downs.append(json.loads(message["data"]))
    assert {"kind": "down", "id": entry["worker_id"]} in downs
    log = worker.log_text()
    assert "the engine thread died" in log and "InjectedFault" in log
    assert "exiting 3 to be restarted" in log
    events.close()
    client.close()


def test_a_stalled_step_counts_as_dead(cluster, redis_server, tiny_llama_path):
    kwargs = ("--engine-stall-timeout", "2")
    worker = _worker(
        cluster, "prefill", tiny_llama_path, redis_server, "engine-stall-after:0", *kwargs
    )
    client = redis.Redis.from_url(redis_server.url)
    assert len(_entries(client, "prefill")) == 1

    async def call():
        params = common_pb2.SamplingParams(max_tokens=8, temperature=0)
        request = prefill_pb2.PrefillRequest(
            request_id="r1", prompt_token_ids=list(range(5, 40)), params=params
        )
        async with aio_channel(worker.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await prefill_pb2_grpc.PrefillStub(ch).Prefill(request, timeout=60)
        return info.value

    statuses, error = asyncio.run(_fail_and_watch(worker.address, call()))
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "stuck in one step" in error.details()
    assert statuses[0] == SERVING and NOT_SERVING in statuses
    assert worker.proc.wait(timeout=30) == 3
    assert _entries(client, "prefill") == []
    assert "--engine-stall-timeout 2" in worker.log_text()
    client.close()


def test_a_decode_stat_waiting_on_a_stalled_engine_answers_unavailable(
    cluster, redis_server, tiny_llama_path
):
    """Stat runs on the engine thread: behind a stuck step it waits, and when the watchdog
    gives the engine up, it says so (UNAVAILABLE), like the requests do."""
    kwargs = ("--engine-stall-timeout", "2")
    worker = _worker(
        cluster, "decode", tiny_llama_path, redis_server, "engine-stall-after:0", *kwargs
    )

    async def run():
        decode = asyncio.create_task(_decode(worker.address, max_tokens=8))
        await asyncio.sleep(0.5)  # its first step has begun, and never returns
        async with aio_channel(worker.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await decode_pb2_grpc.DecodeStub(ch).Stat(
                    decode_pb2.DecodeStatRequest(), timeout=30
                )
        _, decode_error = await decode
        return info.value, decode_error

    error, decode_error = asyncio.run(run())
    assert decode_error.code() == grpc.StatusCode.UNAVAILABLE, decode_error
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "stuck in one step" in error.details()
    assert worker.proc.wait(timeout=30) == 3
    assert "Traceback" not in worker.log_text()


def test_slow_steps_under_the_stall_timeout_do_not_trip_it(cluster, redis_server, tiny_llama_path):
    # Each step takes 0.4 s more: the request takes longer than the stall timeout in all,
    # no one step does.
    kwargs = ("--engine-stall-timeout", "3")
    worker = _worker(
        cluster, "decode", tiny_llama_path, redis_server, "engine-step-delay:0.4", *kwargs
    )

    async def run():
        tokens, error = await _decode(worker.address, max_tokens=10)
        async with aio_channel(worker.address) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
        return tokens, error, health.status

    tokens, error, health = asyncio.run(run())
    assert error is None and len(tokens) == 10
    assert health == SERVING and worker.alive()
    client = redis.Redis.from_url(redis_server.url)
    assert len(_entries(client, "decode")) == 1
    client.close()


def test_a_bad_fault_value_stops_the_start(cluster, redis_server, tiny_llama_path):
    from pdserve.local.launcher import StartFailed

    with pytest.raises(StartFailed, match="exited with code 2") as info:
        _worker(cluster, "decode", tiny_llama_path, redis_server, "engine-explode")
    assert "PDSERVE_TEST_FAULT='engine-explode'" in str(info.value)
