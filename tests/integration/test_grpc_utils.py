"""The shared gRPC helpers over real sockets: health, a taken port refused loudly, and a
channel that dials a restarted peer again within seconds, keepalives from the environment."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.local.launcher import free_port
from pdserve.runtime import rpc as grpc_utils
from pdserve.runtime.rpc import MAX_RECONNECT_BACKOFF_MS, aio_channel, start_server
from pdserve.settings import variables
from pdserve.settings.commands import known_env


async def test_health_serves_and_a_taken_port_is_refused():
    server, port = await start_server("127.0.0.1:0", [], ["pdserve.v1.Example"])
    try:
        async with aio_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            resp = await stub.Check(
                health_pb2.HealthCheckRequest(service="pdserve.v1.Example"), timeout=5
            )
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(OSError, match="cannot bind 127.0.0.1:"):
            await start_server(f"127.0.0.1:{port}", [], [])
    finally:
        await server.stop(0)


async def _answers(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
        return True
    except grpc.aio.AioRpcError:
        return False


async def test_a_peer_back_at_its_address_is_dialled_again_within_the_backoff_cap():
    """Calls fail for 18.5 s; a server starts at the address; the same channel's calls
    succeed within the cap. (gRPC's own backoff, 1 s growing 1.6x with 20 % jitter, would
    be waiting out the 10.5 s after its attempt near 15.8 s.)"""
    address = f"127.0.0.1:{free_port()}"
    async with aio_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        down_until = time.monotonic() + 18.5
        while time.monotonic() < down_until:
            assert not await _answers(stub)
            await asyncio.sleep(0.2)
        server, _ = await start_server(address, [], [])
        try:
            up = time.monotonic()
            while not await _answers(stub):
                took = time.monotonic() - up
                assert took < MAX_RECONNECT_BACKOFF_MS / 1000 + 2, (
                    f"not dialled again in {took:.1f} s"
                )
                await asyncio.sleep(0.1)
        finally:
            await server.stop(0)


def test_keepalive_seconds_come_from_the_environment(monkeypatch, caplog):
    name = variables.GRPC_KEEPALIVE_TIME
    monkeypatch.delenv(name, raising=False)
    assert grpc_utils._seconds_from_env(name, 20.0) == 20.0
    monkeypatch.setenv(name, "2.5")
    assert grpc_utils._seconds_from_env(name, 20.0) == 2.5
    for bad in ("soon", "0", "-3", "1e9"):
        monkeypatch.setenv(name, bad)
        assert grpc_utils._seconds_from_env(name, 20.0) == 20.0
        assert name in caplog.text and repr(bad) in caplog.text
    assert name in known_env()
