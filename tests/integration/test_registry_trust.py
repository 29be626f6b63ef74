"""A registry nobody can poison: a cluster with an internal token signs its registry entries
and events (pdserve.controlplane.signing), and a gateway routes only to entries the
cluster signed, naming its model; Redis itself asks for a password. On the way, the
gateway is ready (/ready) only once a decode worker has registered.

Real processes over a real, password-protected Redis: a decode worker and a gateway that
share the token, and forged entries that point at a fake decode worker in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from pdserve.controlplane.registry import Keys
from pdserve.controlplane.signing import SIGNATURE_FIELD, Verifier, registry_key, signed_json
from pdserve.local.redis_server import start_redis
from tests.helpers.clusters import rest_address, running
from tests.helpers.fake_workers import FakeDecode, serving
from tests.helpers.flags import engine_flags

TOKEN = "the-clusters-internal-token-0123456789"
PASSWORD = "a redis password"
ENGINE = engine_flags(num_kv_blocks=64)


def _forgeries(real: dict, fake_address: str) -> dict[str, dict]:
    """Entries that a writer to Redis without the token could make, each pointing at
    ``fake_address``: by name, the entry as Redis would hold it."""
    now = time.time()
    base = {k: v for k, v in real.items() if k != SIGNATURE_FIELD}
    base.update(address=fake_address, updated_at=now, num_free_blocks=10**6)

    def entry(worker_id: str, key: bytes | None, **changes) -> dict:
        return json.loads(signed_json({**base, "worker_id": worker_id, **changes}, key))

    other = registry_key("another-cluster-token-0123456789")
    ours = registry_key(TOKEN)
    return {
        "unsigned": entry("decode-forged-unsigned", None),
        "wrong-signature": entry("decode-forged-wrong-sig", other),
        # Even signed (a leaked key), an entry must name the model's fingerprint.
        "no-fingerprint": entry("decode-forged-no-fingerprint", ours, fingerprint=""),
        # A real worker's old entry, replayed after it died: its address may be anyone's.
        "replayed": entry("decode-forged-replay", ours, updated_at=now - 3600),
    }


async def test_forged_entries_get_no_prompt_and_no_token(tmp_path, tiny_chat_llama_path):
    server = start_redis(password=PASSWORD)
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, socket_timeout=5).ping()
        fake = FakeDecode([], [[5]], finish_reason="stop")
        async with serving(fake) as (fake_address,):
            await _serve_past_forgeries(
                tmp_path, tiny_chat_llama_path, server.url, fake, fake_address
            )
    finally:
        server.stop()


async def _serve_past_forgeries(tmp_path, model, url, fake, fake_address):
    env = {"PDSERVE_INTERNAL_TOKEN": TOKEN}
    served = ["--model", str(model), "--redis-url", url]
    keys = Keys()
    client = aioredis.Redis.from_url(url, socket_timeout=5)
    with running(tmp_path) as cluster:
        gateway = ["--disaggregation", "off", "--routing", "round-robin", "--served-model-name"]
        cluster.start("gateway", "pdserve.gateway", *served, *gateway, "tiny", env=env)
        # /health is liveness, /ready readiness: no decode worker yet, so not ready (a load
        # balancer sends it nothing) though alive.
        base = f"http://{rest_address(cluster)}"
        async with httpx.AsyncClient(base_url=base, timeout=10) as h:
            assert (await h.get("/health")).status_code == 200
            empty = await h.get("/ready")
            assert empty.status_code == 503
            assert "no live decode worker" in empty.json()["error"]["message"]
            cluster.start("decode", "pdserve.decode", *served, *ENGINE, env=env)
            for _ in range(100):
                ready = await h.get("/ready")
                if ready.status_code == 200:
                    break
                await asyncio.sleep(0.1)
            assert ready.status_code == 200, ready.text
            assert ready.json() == {"status": "ready", "decode_workers": 1}
        [name] = [k async for k in client.scan_iter(match=keys.worker_pattern)]
        real = json.loads(await client.get(name))
        # The worker's own entry is signed with the token's key, and verifies.
        assert Verifier.for_tokens(TOKEN).why_refused(real) is None
        assert Verifier.for_tokens("another-cluster-token-0123456789").why_refused(real)
        forgeries = _forgeries(real, fake_address)
        for forged in forgeries.values():
            await client.set(keys.worker(forged["worker_id"]), json.dumps(forged), px=60_000)
        # A forged "down" for the real worker would take it out of the gateway's view.
        forged_down = json.dumps({"kind": "down", "id": real["worker_id"]})
        await client.publish(keys.events, forged_down)
        await asyncio.sleep(1.5)  # three polls of the registry
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with httpx.AsyncClient(base_url=base, timeout=60) as h:
            answers = await asyncio.gather(
                *(h.post("/v1/chat/completions", json=body) for _ in range(8))
            )
        assert [a.status_code for a in answers] == [200] * 8, answers[0].text
        assert fake.log == [], "a forged entry got a call (and with it the internal token)"
        log = (tmp_path / "gateway.log").read_text()
        for why in ("not signed", "signature is not the cluster's", "heartbeat time"):
            assert why in log, why
        assert "forged 'down'" in log

        # `pdserve status` with the token lists apart what the verifier refuses; without it,
        # every entry, unverified.
        refused = {
            keys.worker(f["worker_id"]) for n, f in forgeries.items() if n != "no-fingerprint"
        }
        checked = await asyncio.to_thread(_status, url, TOKEN)
        assert checked["verified"] and set(checked["refused"]) == refused, checked["refused"]
        listed = {w["worker_id"] for w in checked["pools"]["decode"]["workers"]}
        assert real["worker_id"] in listed and not {k.rpartition(":")[2] for k in refused} & listed
        unchecked = await asyncio.to_thread(_status, url, None)
        assert not unchecked["verified"] and unchecked["refused"] == {}
        assert len(unchecked["pools"]["decode"]["workers"]) == 1 + len(forgeries)
    await client.aclose()


def _status(url: str, token: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_INTERNAL_TOKEN")}
    env["PDSERVE_REDIS_URL"] = url
    if token:
        env["PDSERVE_INTERNAL_TOKEN"] = token
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
