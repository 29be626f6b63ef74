"""bench/serving/hf_server.py as a real process on a tiny random Llama, called with the `openai` client.

The baseline must be a fair floor for benchmarks: greedy output equals
transformers' own `generate`, concurrent requests batch and each ends at its own
length, and bad requests get OpenAI-shaped errors.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
import torch

from tests.helpers.clusters import running, start_hf_server

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tiny_chat_llama_path) -> Path:
    return tiny_chat_llama_path  # named `tiny`, with a chat template


@pytest.fixture(scope="module")
def base_url(model_dir, tmp_path_factory):
    with running(tmp_path_factory.mktemp("hf-server-log")) as c:
        server = start_hf_server(c, model_dir, batch_wait_ms=50)
        yield f"http://{server.address}/v1"


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


def _hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,  # ignore_eos
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_greedy_matches_transformers_generate(client, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tok.encode(PROMPT)
    expected = _hf_greedy(model_dir, prompt_ids, 8)
    extra = {"ignore_eos": True}
    # Token ids in, text out: the text must be the decoding of exactly HF's tokens.
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompt_ids, max_tokens=8, temperature=0, extra_body=extra
    )
    assert out.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 8
    assert out.choices[0].finish_reason == "length"
    # Text in, streamed: the same text, chunk by chunk.
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8
    # A stop string ends the text before it.
    stop = out.choices[0].text[:2]
    cut = client.completions.create(
        model=MODEL_NAME, prompt=prompt_ids, max_tokens=8, temperature=0, stop=[stop]
    )
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == ("", "stop")


def test_chat_streaming_and_not(client):
    messages = [{"role": "user", "content": "the lazy dog"}]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens <= 6
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_seeded_sampling_repeats(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.9)
    a = client.completions.create(seed=7, extra_body={"ignore_eos": True}, **kwargs)
    b = client.completions.create(seed=7, extra_body={"ignore_eos": True}, **kwargs)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.completion_tokens == 8


async def test_concurrent_requests_batch(base_url):
    aclient = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    lengths = [3, 5, 8, 11]
    prompts = [PROMPT, "jumps over", "pdserve serves tokens, fast and exact.", "dog"]
    outs = await asyncio.gather(
        *(
            aclient.completions.create(
                model=MODEL_NAME,
                prompt=p,
                max_tokens=n,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for p, n in zip(prompts, lengths, strict=True)
        )
    )
    assert [o.usage.completion_tokens for o in outs] == lengths
    assert all(o.choices[0].finish_reason == "length" for o in outs)
    # Left-padded in a batch, each answer is still its own greedy answer.
    alone = await aclient.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert alone.choices[0].text == outs[0].choices[0].text


def test_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5000)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
