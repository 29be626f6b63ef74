"""Internal trust over real sockets: the internal token (UNAUTHENTICATED without it, health
open), a whole cluster chatting over mutual TLS with plaintext refused, the decode
worker's kvstore allowlist, and start-up errors that name the flag."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.kv.blocks import LAYOUT_VERSION, BlockLayout
from pdserve.kv.convert import layout_to_proto
from pdserve.kvstore.server import SERVICE_NAME, KVStoreServicer
from pdserve.kvstore.store import BlockStore
from pdserve.runtime.rpc import aio_channel, start_server
from pdserve.runtime.trust import Trust
from pdserve.testing.cluster import Cluster
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.helpers.clusters import running, start_disaggregated
from tests.helpers.flags import engine_flags
from tests.helpers.tls_certs import der, make_cluster_certs, peer_certificate

ROOT = Path(__file__).resolve().parents[2]

TOKEN = "an-internal-token-for-tests-0123456789"
ENGINE = engine_flags(num_kv_blocks=128)
LAYOUT = BlockLayout(LAYOUT_VERSION, b"\x01" * 16, "float32", 16, 2, 2, 16)


def _tls_channel(address: str, certs, *, client_cert: bool = True, token: str | None = TOKEN):
    creds = grpc.ssl_channel_credentials(
        root_certificates=certs.ca.cert_bytes,
        private_key=certs.service.key_bytes if client_cert else None,
        certificate_chain=certs.service.cert_bytes if client_cert else None,
    )
    return aio_channel(address, Trust(token=token, channel_credentials=creds))


async def _code(call) -> tuple[grpc.StatusCode, str]:
    """The status code and details a call ends with (OK when it succeeds)."""
    try:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def _calls(channel):
    """One call of each service a worker cluster runs, each of a different streaming kind."""
    kv = kvstore_pb2_grpc.KVStoreStub(channel["kvstore"])
    layout = layout_to_proto(LAYOUT)
    return {
        "kvstore Stat": lambda: kv.Stat(kvstore_pb2.StatRequest(), timeout=10),
        "kvstore GetBlocks": lambda: kv.GetBlocks(
            kvstore_pb2.GetBlocksRequest(layout=layout, keys=[b"k"]), timeout=10
        ),
        "kvstore PutBlocks": lambda: kv.PutBlocks(
            iter([kvstore_pb2.PutBlocksRequest(layout=layout)]), timeout=10
        ),
        "prefill Prefill": lambda: prefill_pb2_grpc.PrefillStub(channel["prefill"]).Prefill(
            prefill_pb2.PrefillRequest(request_id="r", prompt_token_ids=[5, 6, 7]), timeout=10
        ),
        "decode Decode": lambda: decode_pb2_grpc.DecodeStub(channel["decode"]).Decode(
            decode_pb2.DecodeRequest(request_id="r", prompt_token_ids=[5, 6, 7]), timeout=10
        ),
        "decode Stat": lambda: decode_pb2_grpc.DecodeStub(channel["decode"]).Stat(
            decode_pb2.DecodeStatRequest(), timeout=10
        ),
    }


async def _health(channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status


# -- in one process: the interceptor on every kind of call --------------------------------


async def test_the_token_guards_every_kind_of_call_but_health():
    servicer = KVStoreServicer(BlockStore(1 << 20))
    server, port = await start_server(
        "127.0.0.1:0",
        [lambda s: kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        token=TOKEN,
    )
    address = f"127.0.0.1:{port}"
    try:
        for trust, expect in (
            (None, "no internal token"),
            (Trust(token="another-token-of-enough-length"), "wrong internal token"),
        ):
            async with aio_channel(address, trust) as ch:
                for name, call in _calls({"kvstore": ch, "prefill": ch, "decode": ch}).items():
                    if not name.startswith("kvstore"):
                        continue
                    code, details = await _code(call)
                    assert code == grpc.StatusCode.UNAUTHENTICATED, name
                    assert expect in details and "PDSERVE_INTERNAL_TOKEN" in details, details
                assert await _health(ch) == health_pb2.HealthCheckResponse.SERVING
                # Reflection describes the services: it is behind the token like them.
                stub = reflection_pb2_grpc.ServerReflectionStub(ch)
                code, _ = await _code(
                    lambda stub=stub: stub.ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                        timeout=10,
                    )
                )
                assert code == grpc.StatusCode.UNAUTHENTICATED
        async with aio_channel(address, Trust(token=TOKEN)) as ch:
            for name, call in _calls({"kvstore": ch, "prefill": ch, "decode": ch}).items():
                if name.startswith("kvstore"):
                    assert (await _code(call))[0] == grpc.StatusCode.OK, name
    finally:
        await server.stop(0)


# -- a cluster with the token, plaintext ----------------------------------------------------


@pytest.fixture(scope="module")
def token_cluster(tiny_chat_llama_path, tmp_path_factory):
    env = {"PDSERVE_INTERNAL_TOKEN": TOKEN}  # the children read it; argv never holds it
    with running(tmp_path_factory.mktemp("token-logs")) as c:
        start_disaggregated(
            c, tiny_chat_llama_path, engine=ENGINE, gateway=["--http-port", "-1"], env=env
        )
        yield c
    assert TOKEN not in " ".join(" ".join(s.argv) for s in c.services)
    for svc in c.services:
        assert TOKEN not in svc.log_text(), svc.name


def _chat_request() -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        messages=gateway_pb2.ChatMessages(
            messages=[
                gateway_pb2.ChatMessage(
                    role="user",
                    content="hello there, tell me a story about a cat and a dog, please",
                )
            ]
        ),
        params=common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    )


async def test_without_the_token_workers_and_kvstore_answer_unauthenticated(token_cluster):
    addresses = {n: token_cluster.address(n) for n in ("kvstore", "prefill", "decode")}
    channels = {n: aio_channel(a) for n, a in addresses.items()}
    try:
        for name, call in _calls(channels).items():
            code, details = await _code(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (name, code, details)
            assert "PDSERVE_INTERNAL_TOKEN or --internal-token-file" in details
        for ch in channels.values():
            assert await _health(ch) == health_pb2.HealthCheckResponse.SERVING
    finally:
        for ch in channels.values():
            await ch.close()


async def test_the_gateway_sends_the_token_down_the_whole_path(token_cluster):
    async with aio_channel(token_cluster.address("gateway")) as ch:
        response = await gateway_pb2_grpc.GatewayStub(ch).Generate(_chat_request(), timeout=120)
    assert response.usage.completion_tokens == 8
    async with aio_channel(token_cluster.address("decode"), Trust(token=TOKEN)) as ch:
        stat = await decode_pb2_grpc.DecodeStub(ch).Stat(decode_pb2.DecodeStatRequest(), timeout=10)
    assert stat.kv_blocks_imported >= 1  # the decode worker fetched from the kvstore, with it


async def test_the_decode_worker_dials_no_kvstore_it_does_not_know(token_cluster):
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", 0))
        stranger.listen()
        stranger.setblocking(False)
        address = f"127.0.0.1:{stranger.getsockname()[1]}"
        async with aio_channel(token_cluster.address("prefill"), Trust(token=TOKEN)) as ch:
            pre = await prefill_pb2_grpc.PrefillStub(ch).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="a", prompt_token_ids=list(range(5, 45)),
                    params=common_pb2.SamplingParams(max_tokens=4, temperature=0),
                ),
                timeout=60,
            )  # fmt: skip
        request = decode_pb2.DecodeRequest(
            request_id="a",
            prompt_token_ids=list(range(5, 45)),
            params=common_pb2.SamplingParams(max_tokens=4, temperature=0),
            first_token_id=pre.first_token_id,
            block_keys=list(pre.block_keys),
            kvstore_address=address,
            layout=pre.layout,
        )
        async with aio_channel(token_cluster.address("decode"), Trust(token=TOKEN)) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            code, details = await _code(lambda: stub.Decode(request, timeout=30))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert address in details and "--kvstore" in details
        with pytest.raises(BlockingIOError):
            stranger.accept()  # nobody connected


# -- a cluster over mutual TLS ----------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_cluster_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_cluster(tiny_chat_llama_path, tmp_path_factory, certs):
    token_file = tmp_path_factory.mktemp("secret") / "token"
    token_file.write_text(TOKEN + "\n")
    tls = ["--tls-cert", str(certs.service.cert), "--tls-key", str(certs.service.key)]
    tls += ["--tls-ca", str(certs.ca.cert)]
    internal = [*tls, "--tls-client-ca", str(certs.ca.cert)]
    internal += ["--internal-token-file", str(token_file)]
    # The public front serves TLS with its own certificate (of another CA, as a public one
    # would be); its clients need no certificate of their own.
    public = ["--ssl-certfile", str(certs.stranger.cert), "--ssl-keyfile", str(certs.stranger.key)]
    gateway = ["--http-port", "-1", *tls, *public, "--internal-token-file", str(token_file)]
    with running(tmp_path_factory.mktemp("tls-logs")) as c:
        start_disaggregated(
            c, tiny_chat_llama_path, engine=ENGINE, internal=internal, gateway=gateway
        )
        yield c
    assert not c.unhandled_errors()


async def test_the_cluster_serves_a_chat_over_tls(tls_cluster, certs):
    public = grpc.ssl_channel_credentials(root_certificates=certs.other_ca.cert_bytes)
    async with aio_channel(tls_cluster.address("gateway"), Trust(channel_credentials=public)) as ch:
        response = await gateway_pb2_grpc.GatewayStub(ch).Generate(_chat_request(), timeout=120)
    assert response.usage.completion_tokens == 8 and response.text
    # The public front shows the public certificate, never the cluster's internal one.
    assert peer_certificate(tls_cluster.address("gateway"), certs.other_ca) == der(certs.stranger)
    with pytest.raises(ssl.SSLCertVerificationError):
        peer_certificate(tls_cluster.address("gateway"), certs.ca)
    async with _tls_channel(tls_cluster.address("kvstore"), certs) as ch:
        stat = await kvstore_pb2_grpc.KVStoreStub(ch).Stat(kvstore_pb2.StatRequest(), timeout=10)
    assert stat.blocks_in >= 1 and stat.blocks_out >= 1  # the KV went through it, over TLS


async def test_plaintext_and_strangers_are_refused(tls_cluster, certs):
    for name in ("gateway", "kvstore", "prefill", "decode"):
        async with aio_channel(tls_cluster.address(name), Trust(token=TOKEN)) as ch:
            code, _ = await _code(lambda ch=ch: _health(ch))
            assert code == grpc.StatusCode.UNAVAILABLE, name
    kvstore = tls_cluster.address("kvstore")
    # Mutual TLS: a client without a certificate, or with one of another CA, gets nowhere.
    async with _tls_channel(kvstore, certs, client_cert=False) as ch:
        assert (await _code(lambda: _health(ch)))[0] == grpc.StatusCode.UNAVAILABLE
    stranger = grpc.ssl_channel_credentials(
        root_certificates=certs.ca.cert_bytes,
        private_key=certs.stranger.key_bytes,
        certificate_chain=certs.stranger.cert_bytes,
    )
    async with aio_channel(kvstore, Trust(token=TOKEN, channel_credentials=stranger)) as ch:
        assert (await _code(lambda: _health(ch)))[0] == grpc.StatusCode.UNAVAILABLE
    # A certificate of the cluster is not enough: the token is still needed.
    async with _tls_channel(kvstore, certs, token=None) as ch:
        assert await _health(ch) == health_pb2.HealthCheckResponse.SERVING
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        code, _ = await _code(lambda: stub.Stat(kvstore_pb2.StatRequest(), timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED


# -- start-up errors --------------------------------------------------------------------------


def _kvstore_start(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.kvstore", "--port", "0", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bad_tls_files_stop_the_start_naming_the_flag(certs, tmp_path):
    missing = _kvstore_start("--tls-cert", str(tmp_path / "nope.crt"), "--tls-key", "x.key")
    assert missing.returncode == 2
    assert f"--tls-cert {tmp_path / 'nope.crt'}: cannot read it" in missing.stderr
    other_key = _kvstore_start(
        "--tls-cert", str(certs.service.cert), "--tls-key", str(certs.stranger.key)
    )
    assert other_key.returncode == 2
    assert "are not a PEM certificate chain and its unencrypted private key" in other_key.stderr
    not_a_ca = tmp_path / "ca.pem"
    not_a_ca.write_text("hello\n")
    bad_ca = _kvstore_start(
        "--tls-cert", str(certs.service.cert), "--tls-key", str(certs.service.key),
        "--tls-client-ca", str(not_a_ca),
    )  # fmt: skip
    assert bad_ca.returncode == 2 and "--tls-client-ca" in bad_ca.stderr
    alone = _kvstore_start("--tls-cert", str(certs.service.cert))
    assert alone.returncode == 2 and "--tls-cert and --tls-key go together" in alone.stderr


async def test_the_kvstore_keeps_its_configured_layout(tmp_path):
    from pdserve.kv.client import KVStoreClient
    from pdserve.kvstore.store import layout_to_text

    bad = _kvstore_start("--block-layout", "version=1,dtype=float32")
    assert bad.returncode == 2 and "--block-layout needs exactly the fields" in bad.stderr
    c = Cluster(tmp_path)
    try:
        kv = c.start("kvstore", "pdserve.kvstore", "--block-layout", layout_to_text(LAYOUT))
        other = layout_to_proto(BlockLayout(LAYOUT_VERSION, b"\x02" * 16, "float32", 16, 2, 2, 16))
        async with KVStoreClient(kv.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.put_blocks(other, [(b"k", b"x" * 64, 16)], timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "model_fingerprint: store 010101" in refused.value.details()
            assert (await client.stat(timeout=10)).num_blocks == 0
            data = b"x" * LAYOUT.block_bytes
            await client.put_blocks(layout_to_proto(LAYOUT), [(b"k", data, 16)], timeout=10)
            fetched = await client.get_blocks(layout_to_proto(LAYOUT), [b"k"], timeout=10)
            assert fetched.found == {b"k": data}
    finally:
        c.stop_all()
