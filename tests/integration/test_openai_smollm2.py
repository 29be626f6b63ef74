"""The OpenAI API over a disaggregated cluster serving the real SmolLM2-135M-Instruct (float32),
its decode worker speculating with n-gram lookup."""

from __future__ import annotations

import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.testing.metrics import samples, scrape
from tests.helpers.clusters import rest_address, running, start_disaggregated
from tests.helpers.flags import engine_flags

# The KV cache sized in memory, not in blocks.
ENGINE = engine_flags(num_kv_blocks=None, kv_cache_memory="256MiB", max_model_len=2048)
SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 4}'


@pytest.fixture(scope="module")
def cluster(smollm2_path, tmp_path_factory):
    with running(tmp_path_factory.mktemp("smol-logs")) as c:
        start_disaggregated(
            c,
            smollm2_path,
            engine=ENGINE,
            capacity="256MiB",
            decode=["--speculative-config", SPECULATIVE],
            gateway=["--max-model-len", "2048"],
        )
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://{rest_address(cluster)}/v1", api_key="x", timeout=120)


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


def _spec_counters(address: str) -> dict[str, float]:
    return {
        s.name: s.value
        for s in samples(scrape(f"http://{address}"))
        if s.name.startswith("pdserve:spec_decode_num_")
        and s.name.endswith("_total")
        and "position" not in s.labels
    }


def test_a_speculating_decode_worker_streams_what_the_engine_alone_gives(
    client, cluster, smollm2_path
):
    """The prompt is prefilled by the prefill worker; the decode worker speculates on the
    imported request, and its stream is the text of an engine that does not speculate."""
    text = (
        "The committee approved the annual budget after a long discussion. The river "
        "rebuilt the northern road as planned. Every student visited a quiet garden "
        "before the winter began. My neighbour replaced a broken clock without any help."
    )
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}]
    plain = LLM(
        model=str(smollm2_path), dtype="float32", max_model_len=2048, kv_cache_memory="256MiB"
    )
    want = plain.chat([messages], SamplingParams(max_tokens=80, temperature=0))[0]
    before = _spec_counters(rest_address(cluster))
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=80, temperature=0, stream=True
    )
    got = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert got == want.text
    after = _spec_counters(rest_address(cluster))
    drafted = after["pdserve:spec_decode_num_draft_tokens_total"] - before.get(
        "pdserve:spec_decode_num_draft_tokens_total", 0
    )
    accepted = after["pdserve:spec_decode_num_accepted_tokens_total"] - before.get(
        "pdserve:spec_decode_num_accepted_tokens_total", 0
    )
    assert 0 < accepted <= drafted
    assert accepted > len(want.token_ids) / 4  # the text repeats: most of it was proposed
    assert cluster.unhandled_errors() == []
