"""The OpenAI API over a disaggregated cluster serving the real SmolLM2-135M-Instruct (float32)."""

from __future__ import annotations

import openai
import pytest

from services.engine import LLM, SamplingParams
from tests.cluster import Cluster

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "2048"]


@pytest.fixture(scope="module")
def cluster(smollm2_path, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("smol-logs"))
    model = ["--model", str(smollm2_path)]
    try:
        kv = c.start("kvstore", "services.kvstore", "--capacity-bytes", "256MiB")
        pre = c.start("prefill", "services.prefill", "--kvstore", kv.address, *model, *ENGINE)
        dec = c.start("decode", "services.decode", "--kvstore", kv.address, *model, *ENGINE)
        gw = c.start(
            "gateway",
            "services.gateway",
            "--prefill",
            pre.address,
            "--decode",
            dec.address,
            "--max-model-len",
            "2048",
            *model,
        )
        c.http_address = gw.addresses["gateway-http"]
        yield c
    finally:
        c.stop_all()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="x", timeout=120)


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why do cats purr?"},
    ],
]


def test_greedy_chat_equals_the_in_process_engine(client, smollm2_path):
    llm = LLM(
        model=str(smollm2_path), dtype="float32", max_model_len=2048, kv_cache_memory="256MiB"
    )
    want = llm.chat(CHATS, SamplingParams(max_tokens=48, temperature=0))
    for messages, expected in zip(CHATS, want, strict=True):
        resp = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, max_tokens=48, temperature=0
        )
        assert resp.choices[0].message.content == expected.text
        assert resp.choices[0].finish_reason == (
            "stop" if expected.finish_reason == "stop" else "length"
        )
        assert resp.usage.completion_tokens == len(expected.token_ids)
    assert "Paris" in want[0].text


def test_streamed_multibyte_text_reassembles_exactly(client, cluster):
    messages = [
        {
            "role": "user",
            "content": "Write 'Tokyo is the capital of Japan' in Japanese, then add three emoji.",
        }
    ]
    args = dict(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**args).choices[0].message.content
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**args, stream=True)
        if c.choices
    ]
    assert any(ord(ch) > 0x2FFF for ch in whole), whole  # CJK or emoji: multi-byte in UTF-8
    assert "\ufffd" not in whole
    assert len(pieces) > 5
    assert "".join(pieces) == whole
    assert cluster.unhandled_errors() == []
