"""Rotating the internal token without a refused call: a whole disaggregated cluster over a
registry, every service reading the token from one file, which is rewritten while
requests run (pdserve.runtime.token_ring). Nothing fails; once the overlap is over the new
token is the only one accepted, and the registry entries are signed with it."""

from __future__ import annotations

import asyncio
import json
import os
import time

import grpc
import httpx
import redis.asyncio as aioredis

from pdserve.controlplane.registry import Keys
from pdserve.controlplane.signing import Verifier
from pdserve.local.redis_server import start_redis
from pdserve.runtime.rpc import aio_channel
from pdserve.runtime.trust import Trust
from pdserve.v1 import decode_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from tests.helpers.clusters import rest_address, running
from tests.helpers.flags import engine_flags

OLD = "the-old-internal-token-0123456789abcdef"
NEW = "the-new-internal-token-0123456789abcdef"
OVERLAP_S = 8.0
STREAMS = 8
ENGINE = engine_flags(num_kv_blocks=128)


def _write_atomically(path, text: str) -> None:
    """As the kubelet updates a mounted Secret: a new file renamed over the old one."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


async def _stat_code(address: str, token: str, stub, request) -> grpc.StatusCode:
    async with aio_channel(address, Trust(token=token)) as channel:
        try:
            await stub(channel).Stat(request, timeout=10)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def _until_pools_registered(url: str) -> None:
    client = aioredis.Redis.from_url(url, socket_timeout=5)
    try:
        for _ in range(100):
            if len([k async for k in client.scan_iter(match=Keys().worker_pattern)]) == 3:
                return
            await asyncio.sleep(0.1)
        raise AssertionError("the workers and the kvstore did not register")
    finally:
        await client.aclose()


async def _chats_until(base: str, stop_at: float) -> list[int]:
    """STREAMS clients asking one streamed chat after another until ``stop_at``: statuses."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell me a story about a cat"}],
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": True,
    }

    async def client(h: httpx.AsyncClient) -> list[int]:
        codes = []
        while time.monotonic() < stop_at:
            async with h.stream("POST", "/v1/chat/completions", json=body) as r:
                text = "".join([line async for line in r.aiter_lines()])
                ok = r.status_code == 200 and "[DONE]" in text and '"error"' not in text
                codes.append(200 if ok else r.status_code or 599)
        return codes

    async with httpx.AsyncClient(base_url=base, timeout=60) as h:
        results = await asyncio.gather(*(client(h) for _ in range(STREAMS)))
    return [c for codes in results for c in codes]


async def test_a_new_token_file_rotates_the_cluster_with_no_failed_request(
    tmp_path, tiny_chat_llama_path
):
    token_file = tmp_path / "internal-token"
    _write_atomically(token_file, OLD + "\n")
    server = start_redis()
    try:
        internal = ["--internal-token-file", str(token_file)]
        internal += ["--internal-token-overlap", str(OVERLAP_S), "--redis-url", server.url]
        with running(tmp_path / "logs") as cluster:
            served = ["--model", str(tiny_chat_llama_path)]
            cluster.start("kvstore", "pdserve.kvstore", "--capacity-bytes", "64MiB", *internal)
            cluster.start_many(
                ("prefill", "pdserve.prefill", *served, *ENGINE, *internal),
                ("decode", "pdserve.decode", *served, *ENGINE, *internal),
            )
            gateway = ["--served-model-name", "tiny", *served, *internal]
            cluster.start("gateway", "pdserve.gateway", *gateway)
            await _until_pools_registered(server.url)
            base = f"http://{rest_address(cluster)}"
            # Requests before, through and past the overlap; the file changes 3 s in.
            began = time.monotonic()
            load = asyncio.create_task(_chats_until(base, began + 3 + OVERLAP_S + 3))
            await asyncio.sleep(3)
            _write_atomically(token_file, NEW + "\n")
            codes = await load
            assert codes and set(codes) == {200}, f"{codes.count(200)} of {len(codes)} served"
            assert len(codes) >= 2 * STREAMS

            decode = cluster.address("decode")
            kvstore = cluster.address("kvstore")
            stat = decode_pb2.DecodeStatRequest()
            kv_stat = kvstore_pb2.StatRequest()
            assert await _stat_code(decode, OLD, decode_pb2_grpc.DecodeStub, stat) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            assert await _stat_code(decode, NEW, decode_pb2_grpc.DecodeStub, stat) == (
                grpc.StatusCode.OK
            )
            assert await _stat_code(kvstore, OLD, kvstore_pb2_grpc.KVStoreStub, kv_stat) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            # Every entry is signed with the new token's key now, and only with it.
            client = aioredis.Redis.from_url(server.url, socket_timeout=5)
            keys = [k async for k in client.scan_iter(match=Keys().worker_pattern)]
            entries = [json.loads(await client.get(k)) for k in keys]
            await client.aclose()
            assert len(entries) == 3
            assert all(Verifier.for_tokens(NEW).why_refused(e) is None for e in entries)
            for name in ("gateway", "prefill", "decode", "kvstore"):
                assert "internal token rotated" in (tmp_path / "logs" / f"{name}.log").read_text()
    finally:
        server.stop()
