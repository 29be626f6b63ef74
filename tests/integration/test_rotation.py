"""Rotating the internal token and the TLS certificates without a refused call: a whole
disaggregated cluster over a registry, over mutual TLS, every service reading the token
and its certificate from files that are rewritten while requests run
(pdserve.runtime.token_ring, pdserve.runtime.cert_watch). Nothing fails; afterwards a new
connection is shown the new certificate, the old token is refused once the overlap is
over, and the registry entries are signed with the new one."""

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
from tests.helpers.tls_certs import der, make_ca, make_leaf, peer_certificate

OLD = "the-old-internal-token-0123456789abcdef"
NEW = "the-new-internal-token-0123456789abcdef"
OVERLAP_S = 4.0
STREAMS = 8
ENGINE = engine_flags(num_kv_blocks=128)


def _write_atomically(path, text: str) -> None:
    """As the kubelet updates a mounted Secret: a new file renamed over the old one."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


async def _stat_code(address: str, token: str, stub, request, credentials) -> grpc.StatusCode:
    async with aio_channel(address, Trust(token=token, channel_credentials=credentials)) as channel:
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


async def test_new_certificates_and_token_rotate_the_cluster_with_no_failed_request(
    tmp_path, tiny_chat_llama_path
):
    token_file = tmp_path / "internal-token"
    _write_atomically(token_file, OLD + "\n")
    ca, ca_cert, ca_key = make_ca(tmp_path)
    old = make_leaf(tmp_path, "service", ca_cert, ca_key)  # the files the services read
    old_der = der(old)
    (tmp_path / "renewed").mkdir()
    new = make_leaf(tmp_path / "renewed", "service", ca_cert, ca_key)
    server = start_redis()
    try:
        internal = ["--internal-token-file", str(token_file)]
        internal += ["--internal-token-overlap", str(OVERLAP_S), "--redis-url", server.url]
        internal += ["--tls-cert", str(old.cert), "--tls-key", str(old.key)]
        internal += ["--tls-ca", str(ca.cert), "--tls-client-ca", str(ca.cert)]
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
            # Requests before, through and past the overlap; the files change 2 s in.
            began = time.monotonic()
            load = asyncio.create_task(_chats_until(base, began + 2 + OVERLAP_S + 2))
            await asyncio.sleep(2)
            decode = cluster.address("decode")
            assert peer_certificate(decode, ca, old) == old_der
            # As cert-manager renews: a new key and certificate from the same CA.
            _write_atomically(old.key, new.key.read_text())
            _write_atomically(old.cert, new.cert.read_text())
            _write_atomically(token_file, NEW + "\n")
            codes = await load
            assert codes and set(codes) == {200}, f"{codes.count(200)} of {len(codes)} served"
            assert len(codes) >= 2 * STREAMS

            kvstore = cluster.address("kvstore")
            for address in (decode, kvstore, cluster.address("prefill")):
                assert peer_certificate(address, ca, new) == der(new) != old_der, address
            creds = grpc.ssl_channel_credentials(
                ca.cert.read_bytes(), new.key.read_bytes(), new.cert.read_bytes()
            )
            stat = decode_pb2.DecodeStatRequest()
            kv_stat = kvstore_pb2.StatRequest()
            decode_stub, kv_stub = decode_pb2_grpc.DecodeStub, kvstore_pb2_grpc.KVStoreStub
            assert await _stat_code(decode, OLD, decode_stub, stat, creds) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            assert await _stat_code(decode, NEW, decode_stub, stat, creds) == grpc.StatusCode.OK
            assert await _stat_code(kvstore, OLD, kv_stub, kv_stat, creds) == (
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
                log = (tmp_path / "logs" / f"{name}.log").read_text()
                assert "internal token rotated" in log and "TLS files changed" in log, name
    finally:
        server.stop()
