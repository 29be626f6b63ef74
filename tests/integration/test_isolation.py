"""One request never harms another, on a real cluster (gateway, prefill, kvstore, two decode
workers, the tiny Llama in float32): a poisonous sampling value sent among healthy streams
fails alone, and two clients that send the same ``x-request-id`` at once each get their own
answer, on one decode worker and across two."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve.testing.cluster import Cluster
from tests.helpers.clusters import rest_address, running, start_kvstore
from tests.helpers.flags import engine_flags

ENGINE = engine_flags(num_kv_blocks=512, max_num_seqs=32)
MODEL = "tiny"
MAX_MODEL_LEN = 256
NUM_HEALTHY = 16


@pytest.fixture(scope="module")
def cluster(tiny_chat_llama_path, tmp_path_factory):
    """One prefill and two decode workers; gateway ``one`` sends to the first decode worker
    only, gateway ``two`` to both, in turn."""
    model = ["--model", str(tiny_chat_llama_path)]
    gateway = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL, *model]
    with running(tmp_path_factory.mktemp("isolation-logs")) as c:
        known = start_kvstore(c)
        pre, d0, d1 = c.start_many(
            ("prefill", "pdserve.prefill", *known, *model, *ENGINE),
            ("decode-0", "pdserve.decode", *model, *ENGINE, *known),
            ("decode-1", "pdserve.decode", *model, *ENGINE, *known),
        )
        c.start_many(
            ("gateway-one", "pdserve.gateway", "--prefill", pre.address,
             "--decode", d0.address, *gateway),
            ("gateway-two", "pdserve.gateway", "--prefill", pre.address,
             "--decode", d0.address, "--decode", d1.address, "--routing", "round-robin",
             *gateway),
        )  # fmt: skip
        yield c


def api_url(cluster: Cluster, gateway: str) -> str:
    """The /v1 URL of gateway ``one`` or ``two``."""
    return f"http://{rest_address(cluster, f'gateway-{gateway}')}/v1"


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * k) % 500 + 3 for k in range(12 + i)]


def body(i: int, **extra) -> dict:
    """Request i: greedy for even i, seeded sampling for odd i (both reproducible)."""
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": i}
    return {
        "model": MODEL,
        "prompt": prompt(i),
        "max_tokens": 24,
        "ignore_eos": True,
        "return_token_ids": True,
        **sampling,
        **extra,
    }


async def stream_tokens(client: httpx.AsyncClient, payload: dict, **headers) -> list[int]:
    """The token ids of a streamed completion (vLLM's return_token_ids)."""
    tokens: list[int] = []
    payload = {**payload, "stream": True}
    async with client.stream("POST", "/completions", json=payload, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens.extend(choice.get("token_ids") or [])
    return tokens


async def alone(url: str, payloads: list[dict]) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return [await stream_tokens(client, p) for p in payloads]


# repetition_penalty divides the logits of the prompt's tokens: by the smallest float, every
# positive one overflows to inf and the row's probabilities are NaN. It passes validation
# (the range is (0, 2]), as a temperature of 1e-30 does (greedy below vLLM's epsilon).
POISONS = [
    {"temperature": 0.7, "repetition_penalty": 1e-45},
    {"temperature": 1e-30},
]


@pytest.mark.parametrize("poison", POISONS, ids=["repetition-penalty", "temperature"])
def test_a_poisonous_value_among_16_streams_fails_alone(cluster, poison):
    url = api_url(cluster, "one")
    healthy = [body(i) for i in range(NUM_HEALTHY)]
    want = asyncio.run(alone(url, healthy))

    async def together():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            streams = [stream_tokens(client, p) for p in healthy]
            bad = client.post("/completions", json={**body(99), **poison})
            return await asyncio.gather(bad, *streams)

    bad, *got = asyncio.run(together())
    assert got == want
    assert all(len(t) == 24 for t in got)
    if bad.status_code == 200:  # a temperature below epsilon: a greedy, correct answer
        greedy = asyncio.run(alone(url, [{**body(99), "temperature": 0}]))[0]
        assert bad.json()["choices"][0]["token_ids"] == greedy
    else:
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert "repetition_penalty" in error["message"] and "non-finite" in error["message"]
    # The workers go on serving.
    assert asyncio.run(alone(url, healthy[:2])) == want[:2]
    assert cluster.unhandled_errors() == []


@pytest.mark.parametrize("gateway", ["one", "two"])
def test_two_clients_with_one_request_id_each_get_their_own_answer(cluster, gateway):
    url = api_url(cluster, gateway)
    # Prompts longer than a block and not block-aligned: each has a tail block in the
    # kvstore, keyed by its request's id.
    a, b = body(0, prompt=prompt(30)), body(2, prompt=prompt(41))
    want = asyncio.run(alone(url, [a, b]))
    assert want[0] != want[1]

    async def at_once():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            same = {"x-request-id": "the-same-id"}
            return await asyncio.gather(*(stream_tokens(client, p, **same) for p in (a, b, a, b)))

    got = asyncio.run(at_once())
    assert got == [want[0], want[1], want[0], want[1]]

    async def echoed():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            headers = {"x-request-id": "the-same-id"}
            return await asyncio.gather(
                client.post("/completions", json=a, headers=headers),
                client.post("/completions", json=b, headers=headers),
            )

    for response in asyncio.run(echoed()):
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "the-same-id"  # echoed, not used
        assert response.json()["id"] != "cmpl-the-same-id"
    assert cluster.unhandled_errors() == []
