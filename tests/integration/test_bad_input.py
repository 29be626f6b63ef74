"""Bad input on both fronts of a real gateway (over a decode worker, tiny model): malformed,
wrong types, out of range, oversized, huge lists, unknown model, wrong key. Each gets a 4xx
in OpenAI's shape (REST) or the matching status (gRPC) before a deadline, and the gateway
serves a good request right after."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from pdserve.runtime.rpc import aio_channel
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.helpers.clusters import rest_address, running, start_colocated
from tests.helpers.flags import ENGINE
from tests.helpers.openai_errors import openai_error

MODEL = "tiny"
KEY = "sekret-key"
MAX_MODEL_LEN = 128
MAX_BODY = 256 * 1024
# Every refusal comes within this: a deadline that catches a hang, not a benchmark. An
# oversized gRPC message is refused in 0.1-0.8 s on an idle 2-core machine (one second
# failed once in CI under the whole suite's load).
ANSWER_S = 10.0

LIMITS = [
    "--max-body-bytes",
    str(MAX_BODY),
    "--max-n",
    "4",
    "--max-stop",
    "4",
    "--max-stop-chars",
    "64",
    "--max-logprobs",
    "5",
]

GATEWAY = [
    *("--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL, "--api-key", KEY),
    *LIMITS,
]


# The worker's bound on a grammar's compile: well inside ANSWER_S.
WORKER = [*ENGINE, "--grammar-compile-timeout", "0.3"]


@pytest.fixture(scope="module")
def cluster(tiny_chat_llama_path, tmp_path_factory):
    with running(tmp_path_factory.mktemp("bad-input-logs")) as c:
        start_colocated(c, tiny_chat_llama_path, engine=WORKER, gateway=GATEWAY)
        yield c


SLOW_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "maxLength": 60} for i in range(900)},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TEXT = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4}


def chat(**change) -> dict:
    return {**CHAT, **change}


def text(**change) -> dict:
    return {**TEXT, **change}


# (name, path, body as JSON or raw bytes, headers, status, a word the message must contain)
REST_CASES = [
    ("malformed JSON", "/v1/chat/completions", b'{"model": "tiny", "messages": [', AUTH, 400, ""),
    ("not an object", "/v1/completions", b"[1, 2, 3]", AUTH, 400, ""),
    ("empty body", "/v1/completions", b"", AUTH, 400, ""),
    (
        "max_tokens a string",
        "/v1/chat/completions",
        chat(max_tokens="ten"),
        AUTH,
        400,
        "max_tokens",
    ),
    ("messages a string", "/v1/chat/completions", chat(messages="hi"), AUTH, 400, "messages"),
    (
        "empty role",
        "/v1/chat/completions",
        chat(messages=[{"role": "", "content": "a"}]),
        AUTH,
        400,
        "role",
    ),
    ("unknown field", "/v1/completions", text(best_guess=True), AUTH, 400, "best_guess"),
    (
        "unknown option",
        "/v1/completions",
        text(stream=True, stream_options={"x": 1}),
        AUTH,
        400,
        "stream_options.x",
    ),
    (
        "a field not served",
        "/v1/completions",
        text(use_beam_search=True),
        AUTH,
        400,
        "use_beam_search",
    ),
    (
        "tool_choice naming a missing function",
        "/v1/chat/completions",
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        AUTH,
        400,
        "nope",
    ),
    (
        "a bad JSON schema",
        "/v1/chat/completions",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"foo": "bar"}},
                },
            }
        ),
        AUTH,
        400,
        "schema",
    ),
    (
        "a bad regex",
        "/v1/completions",
        text(structured_outputs={"regex": "[.*"}),
        AUTH,
        400,
        "regex",
    ),
    (
        "two constraints",
        "/v1/completions",
        text(structured_outputs={"regex": "a+", "choice": ["a"]}),
        AUTH,
        400,
        "exactly one",
    ),
    ("temperature a string", "/v1/completions", text(temperature="hot"), AUTH, 400, "temperature"),
    ("negative temperature", "/v1/completions", text(temperature=-1), AUTH, 400, "temperature"),
    (
        "temperature NaN",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "a", "temperature": NaN}',
        AUTH,
        400,
        "temperature",
    ),
    ("top_p above 1", "/v1/completions", text(top_p=2), AUTH, 400, "top_p"),
    ("n zero", "/v1/completions", text(n=0), AUTH, 400, "n"),
    ("n past --max-n", "/v1/completions", text(n=5), AUTH, 400, "n"),
    ("seed below int64", "/v1/completions", text(seed=-(2**70)), AUTH, 400, "seed"),
    ("huge seed", "/v1/completions", text(seed=2**70), AUTH, 400, "seed"),
    (
        "top_logprobs past --max-logprobs",
        "/v1/chat/completions",
        chat(logprobs=True, top_logprobs=9),
        AUTH,
        400,
        "logprobs",
    ),
    (
        "max_tokens past the context",
        "/v1/completions",
        text(max_tokens=500),
        AUTH,
        400,
        str(MAX_MODEL_LEN),
    ),
    (
        "token id past the vocabulary",
        "/v1/completions",
        text(prompt=[5, 10**6]),
        AUTH,
        400,
        "vocabulary",
    ),
    ("token id past uint32", "/v1/completions", text(prompt=[5, 2**40]), AUTH, 400, "vocabulary"),
    ("negative token id", "/v1/completions", text(prompt=[-1]), AUTH, 400, "prompt"),
    ("empty prompt", "/v1/completions", text(prompt=""), AUTH, 400, "empty"),
    ("empty messages", "/v1/chat/completions", chat(messages=[]), AUTH, 400, "messages"),
    ("too many stop strings", "/v1/completions", text(stop=["a"] * 50), AUTH, 400, "stop"),
    ("a long stop string", "/v1/completions", text(stop="x" * 1000), AUTH, 400, "stop"),
    (
        "prompt ids past the context",
        "/v1/completions",
        text(prompt=[5] * 20_000),
        AUTH,
        400,
        "prompt",
    ),
    (
        "many messages past the context",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "a"}] * 3000),
        AUTH,
        400,
        str(MAX_MODEL_LEN),
    ),
    (
        "body past --max-body-bytes",
        "/v1/completions",
        text(prompt="a" * (MAX_BODY + 10)),
        AUTH,
        413,
        "bytes",
    ),
    ("unknown model", "/v1/completions", text(model="gpt-4"), AUTH, 404, "gpt-4"),
    ("no key", "/v1/completions", text(), {}, 401, "API key"),
    ("wrong key", "/v1/completions", text(), {"Authorization": "Bearer nope"}, 401, "API key"),
    ("no key, SageMaker's route", "/invocations", text(), {}, 401, "API key"),
    ("unknown route", "/v1/embeddings", text(), AUTH, 404, ""),
    # Last: its compile goes on in the worker's one compile thread after the refusal (some
    # seconds: xgrammar's compile of many optional properties grows faster than their count).
    (
        "a schema slower to compile than --grammar-compile-timeout",
        "/v1/completions",
        text(structured_outputs={"json": SLOW_SCHEMA}),
        AUTH,
        400,
        "--grammar-compile-timeout",
    ),
]


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=f"http://{rest_address(cluster)}", timeout=30) as client:
        # The first request of a fresh process pays its lazy imports (and the worker's
        # first grammar, xgrammar's): not a refusal's time.
        assert client.post("/v1/completions", json=TEXT, headers=AUTH).status_code == 200
        constrained = text(structured_outputs={"choice": ["a", "b"]})
        assert client.post("/v1/completions", json=constrained, headers=AUTH).status_code == 200
        yield client


@pytest.mark.parametrize(
    "path, payload, headers, status, word",
    [c[1:] for c in REST_CASES],
    ids=[c[0] for c in REST_CASES],
)
def test_rest_refuses_bad_input_in_openai_shape(http, path, payload, headers, status, word):
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", **headers}
    response = http.post(path, content=content, headers=headers, timeout=ANSWER_S)
    error = openai_error(response, status)
    assert word in error["message"], error["message"]
    good = http.post("/v1/completions", json=TEXT, headers=AUTH, timeout=30)
    assert good.status_code == 200, good.text


def ids(n: int) -> gateway_pb2.TokenIds:
    return gateway_pb2.TokenIds(ids=[5] * n)


def params(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=kw.pop("max_tokens", 4), **kw)


def request(**kw) -> gateway_pb2.GenerateRequest:
    kw.setdefault("prompt_token_ids", ids(3))
    kw.setdefault("params", params())
    return gateway_pb2.GenerateRequest(**kw)


OK = (("authorization", f"Bearer {KEY}"),)
BAD = grpc.StatusCode.INVALID_ARGUMENT

# (name, request or raw bytes, metadata, status, a word the details must contain)
GRPC_CASES = [
    ("malformed message", b"\xff\xff\xff\x0f\x01", OK, BAD, "GenerateRequest"),
    ("no input", gateway_pb2.GenerateRequest(params=params()), OK, BAD, "input"),
    ("empty prompt", request(prompt_token_ids=None, prompt=""), OK, BAD, "empty"),
    (
        "empty chat",
        request(prompt_token_ids=None, messages=gateway_pb2.ChatMessages()),
        OK,
        BAD,
        "messages",
    ),
    ("negative temperature", request(params=params(temperature=-1)), OK, BAD, "temperature"),
    ("temperature NaN", request(params=params(temperature=float("nan"))), OK, BAD, "temperature"),
    ("top_p above 1", request(params=params(top_p=2)), OK, BAD, "top_p"),
    ("logprobs past --max-logprobs", request(params=params(logprobs=9)), OK, BAD, "logprobs"),
    (
        "max_tokens past the context",
        request(params=params(max_tokens=500)),
        OK,
        BAD,
        str(MAX_MODEL_LEN),
    ),
    (
        "token id past the vocabulary",
        request(prompt_token_ids=gateway_pb2.TokenIds(ids=[10**6])),
        OK,
        BAD,
        "vocabulary",
    ),
    ("prompt ids past the context", request(prompt_token_ids=ids(20_000)), OK, BAD, "prompt"),
    ("too many stop strings", request(stop=["a"] * 50), OK, BAD, "stop"),
    ("a long stop string", request(stop=["x" * 1000]), OK, BAD, "stop"),
    (
        "too many stop token ids",
        request(params=params(stop_token_ids=[1] * 50)),
        OK,
        BAD,
        "stop_token_ids",
    ),
    (
        "message past --max-body-bytes",
        request(prompt_token_ids=None, prompt="a" * (MAX_BODY + 10)),
        OK,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "",
    ),
    ("no key", request(), (), grpc.StatusCode.UNAUTHENTICATED, "API key"),
    (
        "wrong key",
        request(),
        (("authorization", "Bearer nope"),),
        grpc.StatusCode.UNAUTHENTICATED,
        "API key",
    ),
]


async def _call(address: str, payload, metadata, method: str):
    async with aio_channel(address) as channel:
        if isinstance(payload, bytes):
            call = (
                channel.unary_unary(f"/pdserve.v1.Gateway/{method}")
                if method == "Generate"
                else channel.unary_stream(f"/pdserve.v1.Gateway/{method}")
            )
        else:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            call = getattr(stub, method)
        if method == "Generate":
            return await call(payload, metadata=metadata, timeout=ANSWER_S)
        return [m async for m in call(payload, metadata=metadata, timeout=ANSWER_S)]


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
@pytest.mark.parametrize(
    "payload, metadata, code, word", [c[1:] for c in GRPC_CASES], ids=[c[0] for c in GRPC_CASES]
)
def test_grpc_refuses_bad_input_with_the_matching_status(
    http, cluster, method, payload, metadata, code, word
):
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        asyncio.run(_call(cluster.address("gateway"), payload, metadata, method))
    assert raised.value.code() == code, raised.value.details()
    assert word in (raised.value.details() or ""), raised.value.details()
    good = asyncio.run(_call(cluster.address("gateway"), request(), OK, "Generate"))
    assert good.finish_reason == "length" and len(good.token_ids) == 4


def test_grpc_health_and_rest_health_stay_open_without_a_key(http, cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def check():
        async with aio_channel(cluster.address("gateway")) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

    assert asyncio.run(check()).status == 1  # SERVING
    assert http.get("/health").status_code == 200
