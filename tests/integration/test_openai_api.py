"""The gateway's OpenAI REST API, served by a real cluster and called with the `openai` client:
gateway (gRPC + REST) -> prefill worker -> kvstore -> decode worker."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.testing.cluster import decode_stat
from tests.helpers.clusters import rest_address, running, start_disaggregated
from tests.helpers.openai_errors import openai_error

MAX_MODEL_LEN = 256
MODEL_NAME = "tiny"
PROMPT_IDS = [11, 57, 203, 9, 140, 33, 77, 5, 300, 41]
GATEWAY = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL_NAME]
GATEWAY += ["--enable-prompt-tokens-details"]


@pytest.fixture(scope="module")
def cluster(tiny_chat_llama_path, tmp_path_factory):
    with running(tmp_path_factory.mktemp("openai-logs")) as c:
        start_disaggregated(c, tiny_chat_llama_path, gateway=GATEWAY)
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    base_url = f"http://{rest_address(cluster)}/v1"
    return openai.OpenAI(base_url=base_url, api_key="x", timeout=60)


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=f"http://{rest_address(cluster)}", timeout=60) as h:
        yield h


def test_metrics_are_prometheus_text(http):
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'pdserve:num_requests_running{model_name="tiny",role="gateway"} 0.0' in r.text
    assert "# TYPE pdserve:num_requests_waiting gauge" in r.text


def test_models_and_health(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    card = http.get("/v1/models").json()["data"][0]
    assert card["root"] == MODEL_NAME and card["parent"] is None
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


def test_greedy_completion_equals_the_engine(client, tiny_chat_llama_path, cluster):
    llm = LLM(
        model=str(tiny_chat_llama_path), dtype="float32", num_kv_blocks=64, enforce_eager=True
    )
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


def test_logprobs_equal_the_engines(client, tiny_chat_llama_path):
    llm = LLM(
        model=str(tiny_chat_llama_path), dtype="float32", num_kv_blocks=64, enforce_eager=True
    )
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    (want,) = llm.generate([PROMPT_IDS], params)
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT_IDS,
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in want.token_ids]
    assert all(
        len(top) <= 2 and max(top.values()) == pytest.approx(v, abs=1e-4)
        for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )

    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "the quick"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy
    streamed = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "the quick"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    got = [
        e.logprob
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert got == pytest.approx([e.logprob for e in content], abs=1e-6)


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


def test_bad_requests_get_openai_errors(http):
    def chat(**fields):
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **fields}
        return http.post("/v1/chat/completions", json=body)

    bad_temperature = openai_error(chat(temperature=-1), 400)
    assert "temperature" in bad_temperature["message"] and bad_temperature["param"] == "temperature"
    openai_error(chat(messages=[]), 400)
    assert "top_p" in openai_error(chat(top_p=0), 400)["message"]
    openai_error(chat(n=0), 400)
    openai_error(chat(messages="hi"), 400)
    openai_error(http.post("/v1/chat/completions", content=b"{not json"), 400)
    too_long = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": [5] * (MAX_MODEL_LEN + 10)}
    )
    message = openai_error(too_long, 400)["message"]
    assert str(MAX_MODEL_LEN + 10) in message and str(MAX_MODEL_LEN) in message
    unknown = openai_error(chat(model="gpt-4"), 404)
    assert unknown["code"] == "model_not_found" and "gpt-4" in unknown["message"]


def test_the_clients_request_id_is_echoed_and_the_gateways_own_is_used(http):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    first, second = (
        http.post("/v1/completions", json=body, headers={"x-request-id": "my-id-1"})
        for _ in range(2)
    )
    for response in (first, second):
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "my-id-1"
    ids = {first.json()["id"], second.json()["id"]}
    assert len(ids) == 2 and all(i.startswith("cmpl-") and "my-id-1" not in i for i in ids)
    anonymous = http.post("/v1/completions", json=body)
    assert anonymous.json()["id"] == f"cmpl-{anonymous.headers['x-request-id']}"
    assert http.get("/health").headers["x-request-id"]


def test_disconnect_mid_stream_cancels_the_generation(cluster, http):
    decode = cluster.address("decode")
    start = asyncio.run(decode_stat(decode))
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
        now = asyncio.run(decode_stat(decode))
        if now.num_running == 0 and now.num_free_blocks == start.num_free_blocks:
            break
        time.sleep(0.1)
    assert now.num_running == 0
    assert now.num_free_blocks == start.num_free_blocks
    assert "Traceback" not in next(s for s in cluster.services if s.name == "gateway").log_text()


async def _take_events(lines, count):
    async for line in lines:
        if line:
            yield line
            count -= 1
            if not count:
                return


def test_20_clients_dropping_mid_stream_free_every_decode_block(cluster):
    decode = cluster.address("decode")
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT_IDS,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def drop_after_a_few_chunks(client):
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = [line async for line in _take_events(response.aiter_lines(), 3)]
            assert all(line.startswith("data: {") for line in events)
        # Leaving the block closes the connection mid-stream.

    async def run():
        start = await decode_stat(decode)
        limits = httpx.Limits(max_connections=20)
        base = f"http://{rest_address(cluster)}"
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
            await asyncio.wait_for(
                asyncio.gather(*(drop_after_a_few_chunks(client) for _ in range(20))), 120
            )
        deadline = time.monotonic() + 30
        while True:
            now = await decode_stat(decode)
            settled = now.num_running == 0 and now.num_free_blocks == start.num_free_blocks
            if settled or time.monotonic() > deadline:
                return start, now
            await asyncio.sleep(0.1)

    start, now = asyncio.run(run())
    assert now.num_running == 0
    assert now.num_free_blocks == start.num_free_blocks
    assert cluster.unhandled_errors() == []
