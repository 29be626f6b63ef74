"""Clients that stop reading their streams, on a real gateway over a decode worker (tiny
model): past ``--send-timeout`` their streams are cancelled and their admission slots
freed, and the gateway answers other clients all along. REST (SSE) and gRPC."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import grpc
import httpx
import pytest

from pdserve.testing.metrics import value
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.helpers.clusters import rest_address, running, start_colocated
from tests.helpers.flags import engine_flags

ENGINE = engine_flags(num_kv_blocks=8192, max_num_seqs=128)
MODEL = "tiny"
SEND_TIMEOUT_S = 5.0
NUM_STALLED = 16
FREED_WITHIN_S = 90.0  # a deadline for the slots to come back, not a benchmark
GATEWAY = [
    *("--served-model-name", MODEL, "--send-timeout", str(SEND_TIMEOUT_S)),
    *("--max-concurrent-requests", str(NUM_STALLED + 8)),
]


@pytest.fixture(scope="module")
def cluster(tiny_chat_llama_path, tmp_path_factory):
    with running(tmp_path_factory.mktemp("slow-reader-logs")) as c:
        start_colocated(c, tiny_chat_llama_path, engine=ENGINE, gateway=GATEWAY)
        yield c


# Two choices of many tokens with top logprobs: some 600 kB of events, more than the
# sockets' buffers hold (the gateway's send buffer, see pdserve.gateway.http, and a small
# receive buffer here).
STALLING = {
    "model": MODEL,
    "prompt": [5, 6, 7, 8],
    "max_tokens": 900,
    "n": 2,
    "ignore_eos": True,
    "temperature": 0,
    "logprobs": 5,
    "stream": True,
}


def stalled_client(address: str) -> socket.socket:
    """A connection that sends a streaming request and then never reads."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.connect((host, int(port)))
    body = json.dumps(STALLING).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


def slots_in_use(http: httpx.Client) -> int:
    return _slots_in_use(http.get("/metrics").text)


def _slots_in_use(metrics: str) -> int:
    """The gateway's admission slots in use, from its /metrics."""
    return int(value(metrics, "pdserve:num_requests_running"))


def test_stalled_sse_readers_lose_their_slots_and_others_are_served(cluster):
    with httpx.Client(base_url=f"http://{rest_address(cluster)}", timeout=30) as http:
        sockets = [stalled_client(rest_address(cluster)) for _ in range(NUM_STALLED)]
        try:
            deadline = time.monotonic() + 30
            while slots_in_use(http) < NUM_STALLED and time.monotonic() < deadline:
                time.sleep(0.1)
            assert slots_in_use(http) == NUM_STALLED
            # Meanwhile others are answered.
            served = 0
            deadline = time.monotonic() + FREED_WITHIN_S
            while slots_in_use(http) > 0 and time.monotonic() < deadline:
                body = {"model": MODEL, "prompt": [9, 10], "max_tokens": 4, "temperature": 0}
                response = http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                served += 1
                time.sleep(0.2)
            # The stalled clients are still connected, reading nothing; their slots are free.
            assert slots_in_use(http) == 0
            assert served >= 1
        finally:
            for sock in sockets:
                sock.close()
    log = next(s for s in cluster.services if s.name == "gateway").log_text()
    assert log.count("the client read nothing") == NUM_STALLED
    assert cluster.unhandled_errors() == []


def test_a_stalled_grpc_reader_loses_its_slot(cluster):
    request = gateway_pb2.GenerateRequest(
        prompt_token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7]),
        params=common_pb2.SamplingParams(
            max_tokens=900, temperature=0, ignore_eos=True, logprobs=5
        ),
    )
    # A small, fixed flow-control window on the client: the server's writes soon wait.
    options = [("grpc.http2.lookahead_bytes", 4096), ("grpc.http2.bdp_probe", 0)]

    async def scenario() -> tuple[int, int]:
        async with (
            grpc.aio.insecure_channel(cluster.address("gateway"), options=options) as channel,
            httpx.AsyncClient(base_url=f"http://{rest_address(cluster)}") as http,
        ):
            call = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(request, timeout=120)
            await call.read()  # started; from here on nothing is read
            started = await aslots_in_use(http)
            deadline = time.monotonic() + FREED_WITHIN_S
            while (now := await aslots_in_use(http)) > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            call.cancel()
            return started, now

    assert asyncio.run(scenario()) == (1, 0)
    log = next(s for s in cluster.services if s.name == "gateway").log_text()
    assert log.count("the client read nothing") == NUM_STALLED + 1


async def aslots_in_use(http: httpx.AsyncClient) -> int:
    return _slots_in_use((await http.get("/metrics")).text)
