"""The OpenAI REST app in this process over fake decode workers: a client that leaves cancels
the decode call, and the guards answer overload (429), no worker (503), a large body (413)
and a wrong API key (401) in OpenAI's shape, under a root path too."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
import openai
import pytest

from pdserve.core.tokenizer import Tokenizer
from pdserve.gateway.admission import Admission
from pdserve.gateway.http import HttpServer
from pdserve.gateway.openai_api import Served, create_app
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.requests import ModelLimits
from pdserve.settings.services import OpenAISettings
from tests.helpers.fake_workers import FakeDecode, orchestrating, serving
from tests.helpers.openai_errors import openai_error

MAX_MODEL_LEN = 256
MODEL_NAME = "tiny"
PROMPT_IDS = [11, 57, 203, 9, 140, 33, 77, 5, 300, 41]

# -- cancellation, seen by a fake decode worker ---------------------------------------------


@asynccontextmanager
async def rest_over_fake_decode(tiny_llama_path, num_tokens=1000, **guards):
    """The REST app in this process over a fake decode worker that streams ``num_tokens``
    (by default: until cancelled); ``guards`` are Served's api_key, max_body_bytes,
    admission and openai settings."""
    decode = FakeDecode([], [[5]] * num_tokens, delay_s=0.02)
    tokenizer = Tokenizer.from_dir(tiny_llama_path)
    async with serving(decode) as (d,), orchestrating([], [d], disaggregation=False) as orch:
        limits = ModelLimits(MAX_MODEL_LEN, 512)
        served = Served(orch, tokenizer, limits, MODEL_NAME, **guards)
        http = await HttpServer.start(create_app(served), "127.0.0.1", 0, drain_timeout_s=1)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http.port}") as client:
                yield client, decode
        finally:
            await http.stop()


BODY = {"model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": 200}


async def test_disconnect_mid_stream_cancels_the_decode_call(tiny_llama_path):
    async with rest_over_fake_decode(tiny_llama_path) as (client, decode):
        body = {**BODY, "stream": True, "n": 2}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: {")
        await asyncio.wait_for(decode.cancelled.wait(), 5)


async def test_disconnect_while_waiting_for_a_whole_reply_cancels_the_decode_call(
    tiny_llama_path,
):
    async with rest_over_fake_decode(tiny_llama_path) as (client, decode):
        request = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await asyncio.wait_for(decode.started.wait(), 10)
        await asyncio.sleep(0.1)  # a few tokens
        request.cancel()  # closes the connection
        await asyncio.wait_for(decode.cancelled.wait(), 5)


# -- guards: overload, unavailable workers, body size, API key ------------------------------


async def test_overload_gets_429_with_retry_after(tiny_llama_path):
    admission = Admission(max_running=1, max_waiting=1, wait_timeout_s=0.5)
    async with rest_over_fake_decode(tiny_llama_path, admission=admission) as (client, _):
        body = {**BODY, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            waiting = asyncio.create_task(client.post("/v1/completions", json=BODY))
            await asyncio.sleep(0.1)
            refused = await client.post("/v1/completions", json=BODY)  # the queue is full
            timed_out = await asyncio.wait_for(waiting, 5)  # waited past its deadline
        for response in (refused, timed_out):
            openai_error(response, 429)
            assert response.headers["retry-after"] == "1"
        assert "busy" in refused.json()["error"]["message"]
        assert await _stream_starts(client)
    assert admission.num_running == 0 and admission.num_waiting == 0


async def _stream_starts(client) -> bool:
    """Whether a streamed completion starts (the fake worker never ends it)."""
    async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        return r.status_code == 200 and (await anext(r.aiter_lines())).startswith("data: {")


async def test_no_reachable_decode_worker_gets_503_with_retry_after(tiny_llama_path):
    tokenizer = Tokenizer.from_dir(tiny_llama_path)
    orch = Orchestrator.with_addresses(
        (), ("127.0.0.1:1",), False, prefill_timeout_s=5, decode_timeout_s=5
    )
    served = Served(orch, tokenizer, ModelLimits(MAX_MODEL_LEN, 512), MODEL_NAME)
    http = await HttpServer.start(create_app(served), "127.0.0.1", 0, drain_timeout_s=1)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http.port}", timeout=20) as c:
            for stream in (False, True):
                response = await c.post("/v1/completions", json={**BODY, "stream": stream})
                openai_error(response, 503)
                assert response.headers["retry-after"] == "1"
        assert served.admission.num_running == 0
    finally:
        await http.stop()
        await orch.close()


async def test_a_body_over_the_limit_gets_413(tiny_llama_path):
    async with rest_over_fake_decode(tiny_llama_path, max_body_bytes=2048) as (client, _):
        big = {**BODY, "prompt": "a" * 4096}
        assert openai_error(await client.post("/v1/completions", json=big), 413)["message"]

        async def chunked():  # no Content-Length: the limit holds while reading
            for _ in range(8):
                yield b" " * 512

        response = await client.post(
            "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
        )
        assert "content-length" not in response.request.headers
        openai_error(response, 413)
        assert await _stream_starts(client)


async def test_api_key_guards_the_v1_routes(tiny_llama_path):
    async with rest_over_fake_decode(tiny_llama_path, api_key="sekret") as (client, _):
        base = str(client.base_url)
        for headers in ({}, {"authorization": "Bearer wrong"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
                response = await client.request(method, path, json=BODY, headers=headers)
                assert openai_error(response, 401)["code"] == "invalid_api_key"
        assert (await client.get("/health")).status_code == 200
        good = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sekret", timeout=20)
        # The fake worker streams until cancelled: read one chunk, then close.
        stream = await good.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, stream=True)
        async with stream:
            assert (await anext(aiter(stream))).choices[0].text is not None
        bad = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="wrong", timeout=20, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()


async def test_root_path_serves_the_api_under_a_prefix_too(tiny_llama_path):
    """vLLM's ``--root-path /llm``: /llm/v1/... and /v1/... are the same API, the key guards
    both, and a path that only begins with the prefix's letters is not under it."""
    settings = OpenAISettings(root_path="/llm/")
    async with rest_over_fake_decode(tiny_llama_path, api_key="sekret", openai=settings) as (
        client,
        _,
    ):
        base = str(client.base_url)
        key = {"authorization": "Bearer sekret"}
        for prefix in ("", "/llm"):
            assert openai_error(await client.get(f"{prefix}/v1/models"), 401)["code"] == (
                "invalid_api_key"
            )
            models = await client.get(f"{prefix}/v1/models", headers=key)
            assert models.status_code == 200
            assert models.json()["data"][0]["id"] == MODEL_NAME
            assert (await client.get(f"{prefix}/health")).status_code == 200
        assert (await client.get("/llmx/v1/models", headers=key)).status_code == 404
        assert (await client.get("/llm", headers=key)).status_code == 404
        good = openai.AsyncOpenAI(base_url=f"{base}/llm/v1", api_key="sekret", timeout=20)
        stream = await good.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, stream=True)
        async with stream:
            assert (await anext(aiter(stream))).choices[0].text is not None


# -- load reports: vLLM's /load and ORCA's endpoint-load-metrics ----------------------------


async def test_load_counts_the_requests_in_the_gateway(tiny_llama_path):
    async with rest_over_fake_decode(tiny_llama_path) as (client, decode):
        assert (await client.get("/load")).json() == {"server_load": 0}
        body = {**BODY, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert (await anext(response.aiter_lines())).startswith("data: {")
            assert (await client.get("/load")).json() == {"server_load": 1}
        await asyncio.wait_for(decode.cancelled.wait(), 5)
        for _ in range(50):  # the slot is freed as the stream's task ends
            if (await client.get("/load")).json()["server_load"] == 0:
                break
            await asyncio.sleep(0.05)
        assert (await client.get("/load")).json() == {"server_load": 0}


async def test_orca_load_report_when_a_request_asks_for_one(tiny_llama_path):
    async with rest_over_fake_decode(tiny_llama_path, num_tokens=3) as (client, _):
        short = {**BODY, "max_tokens": 3}
        plain = await client.post("/v1/completions", json=short)
        assert plain.status_code == 200 and "endpoint-load-metrics" not in plain.headers
        text = await client.post(
            "/v1/completions", json=short, headers={"endpoint-load-metrics-format": "TEXT"}
        )
        assert text.status_code == 200
        # Static pools report no KV blocks: only the queue (this gateway's and the workers').
        assert text.headers["endpoint-load-metrics"] == (
            "TEXT named_metrics.num_requests_waiting=0.0"
        )
        # Chat and completions answer through the same path (the tiny model has no template).
        answer = await client.post(
            "/v1/completions", json=short, headers={"endpoint-load-metrics-format": "json"}
        )
        assert answer.status_code == 200, answer.text
        kind, _, report = answer.headers["endpoint-load-metrics"].partition(" ")
        assert kind == "JSON"
        assert json.loads(report) == {"named_metrics": {"num_requests_waiting": 0.0}}
        other = await client.post(
            "/v1/completions", json=short, headers={"endpoint-load-metrics-format": "xml"}
        )
        assert other.status_code == 200 and "endpoint-load-metrics" not in other.headers
