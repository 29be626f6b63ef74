"""The gateway's OpenAI REST API, served by a real cluster and called with the `openai` client:
gateway (gRPC + REST) -> prefill worker -> kvstore -> decode worker."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from contextlib import asynccontextmanager

import httpx
import openai
import pytest

from services.common.grpc_utils import aio_channel
from services.common.pb import decode_pb2, decode_pb2_grpc
from services.engine import LLM, SamplingParams
from services.gateway.http import HttpServer
from services.gateway.openai_api import Served, create_app
from services.gateway.requests import ModelLimits
from tests.cluster import Cluster
from tests.integration.test_gateway_orchestration import FakeDecode, orchestrating, serving

ENGINE = ["--dtype", "float32", "--num-kv-blocks", "256"]
MAX_MODEL_LEN = 256
MODEL_NAME = "tiny"
PROMPT_IDS = [11, 57, 203, 9, 140, 33, 77, 5, 300, 41]


@pytest.fixture(scope="module")
def chat_model(tiny_llama_path, tmp_path_factory):
    # The tiny tokenizer has no chat template: give it a minimal one.
    model = tmp_path_factory.mktemp("openai") / "m"
    shutil.copytree(tiny_llama_path, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    return model


@pytest.fixture(scope="module")
def cluster(chat_model, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("openai-logs"))
    model = ["--model", str(chat_model)]
    try:
        kv = c.start("kvstore", "services.kvstore", "--capacity-bytes", "64MiB")
        pre = c.start("prefill", "services.prefill", "--kvstore", kv.address, *model, *ENGINE)
        dec = c.start("decode", "services.decode", *model, *ENGINE)
        gw = c.start(
            "gateway",
            "services.gateway",
            "--prefill",
            pre.address,
            "--decode",
            dec.address,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--served-model-name",
            MODEL_NAME,
            *model,
        )
        c.http_address = _http_ready_line(gw)
        yield c
    finally:
        c.stop_all()


def _http_ready_line(gateway) -> str:
    """The REST address from the gateway's second READY line (Cluster reads only the first)."""
    line = gateway.proc.stdout.readline().strip()
    match = re.fullmatch(r"READY gateway-http (\S+)", line)
    assert match, f"expected the HTTP READY line, got {line!r}"
    return match.group(1)


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="x", timeout=60)


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=f"http://{cluster.http_address}", timeout=60) as h:
        yield h


def _addr(cluster, name):
    return next(s.address for s in cluster.services if s.name == name)


def test_models_and_health(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert http.get("/health").status_code == 200


def test_greedy_completion_equals_the_engine(client, chat_model, cluster):
    llm = LLM(model=str(chat_model), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = llm.generate([PROMPT_IDS], params)[0].token_ids
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT_IDS,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == list(expected)
    assert choice.text == llm.tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(PROMPT_IDS)
    assert out.usage.completion_tokens == 8 and out.usage.total_tokens == len(PROMPT_IDS) + 8
    assert out.usage.prompt_tokens_details.cached_tokens >= 0

    # Streamed, the same text and tokens, the usage last.
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT_IDS,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert cluster.unhandled_errors() == []


def test_chat_streaming_and_not(client):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "the fox"},
    ]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=6, temperature=0
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens > 0 and 1 <= whole.usage.completion_tokens <= 6
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_and_seeded_sampling(client):
    def sample(seed, n=2, stream=False):
        return client.completions.create(
            model=MODEL_NAME,
            prompt="the quick brown fox",
            max_tokens=8,
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            n=n,
            stream=stream,
            extra_body={"ignore_eos": True},
        )

    a, b = sample(7), sample(7)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 16
    # Choice i samples with seed + i: choice 1 of seed 7 is choice 0 of seed 8.
    assert sample(8, n=1).choices[0].text == a.choices[1].text
    texts = ["", ""]
    for chunk in sample(7, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in a.choices]


def test_stop_string(client):
    base = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = base.choices[0].text
    stop = text[3:6]
    assert stop.strip(), f"pick another slice of {text!r}"
    cut = text[: text.index(stop)]
    for stream in (False, True):
        out = client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT_IDS,
            max_tokens=12,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"


def _error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_bad_requests_get_openai_errors(http):
    def chat(**fields):
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **fields}
        return http.post("/v1/chat/completions", json=body)

    bad_temperature = _error(chat(temperature=-1), 400)
    assert "temperature" in bad_temperature["message"] and bad_temperature["param"] == "temperature"
    _error(chat(messages=[]), 400)
    assert "top_p" in _error(chat(top_p=0), 400)["message"]
    _error(chat(n=0), 400)
    _error(chat(messages="hi"), 400)
    _error(http.post("/v1/chat/completions", content=b"{not json"), 400)
    too_long = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": [5] * (MAX_MODEL_LEN + 10)}
    )
    message = _error(too_long, 400)["message"]
    assert str(MAX_MODEL_LEN + 10) in message and str(MAX_MODEL_LEN) in message
    unknown = _error(chat(model="gpt-4"), 404)
    assert unknown["code"] == "model_not_found" and "gpt-4" in unknown["message"]


def test_request_id_is_echoed(http):
    response = http.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
        headers={"x-request-id": "my-id-1"},
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "my-id-1"
    assert response.json()["id"] == "cmpl-my-id-1"
    assert http.get("/health").headers["x-request-id"]


def test_disconnect_mid_stream_cancels_the_generation(cluster, http):
    async def decode_stat():
        async with aio_channel(_addr(cluster, "decode")) as ch:
            return await decode_pb2_grpc.DecodeStub(ch).Stat(
                decode_pb2.DecodeStatRequest(), timeout=10
            )

    start = asyncio.run(decode_stat())
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT_IDS,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        got = [line for line, _ in zip(lines, range(4), strict=False)]
        assert all(line.startswith("data: ") or not line for line in got)
    # Leaving the block closed the connection mid-stream.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        now = asyncio.run(decode_stat())
        if now.num_running == 0 and now.num_free_blocks == start.num_free_blocks:
            break
        time.sleep(0.1)
    assert now.num_running == 0
    assert now.num_free_blocks == start.num_free_blocks
    assert "Traceback" not in next(s for s in cluster.services if s.name == "gateway").log_text()


# -- cancellation, seen by a fake decode worker ---------------------------------------------


@asynccontextmanager
async def rest_over_fake_decode(tiny_llama_path):
    """The REST app in this process over a fake decode worker that streams until cancelled."""
    from transformers import AutoTokenizer

    decode = FakeDecode([], [[5]] * 1000, delay_s=0.02)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    async with serving(decode) as (d,), orchestrating([], [d], disaggregation=False) as orch:
        served = Served(orch, tokenizer, ModelLimits(MAX_MODEL_LEN, 512), MODEL_NAME)
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
        await asyncio.sleep(0.5)
        request.cancel()  # closes the connection
        await asyncio.wait_for(decode.cancelled.wait(), 5)
