"""The shared gRPC server helper over real sockets: health, and a taken port refused loudly."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_utils import aio_channel, start_server


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
