"""The OpenAI API over a disaggregated cluster serving the real SmolLM2-135M-Instruct (float32),
its decode worker speculating with n-gram lookup: plain chats against the engine alone,
structured outputs through the openai SDK's ``parse``, and tool calls (``required``, a named
function, and ``auto`` read by the hermes parser), unary and streamed."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.testing.chat_templates import SMOLLM2_TOOLS
from pdserve.testing.metrics import samples, scrape
from pdserve.testing.schemas import MODELS, PROMPTS, SUBJECTS, TIME_TOOL, WEATHER_TOOL
from tests.helpers.clusters import rest_address, running, start_disaggregated
from tests.helpers.flags import engine_flags

# The KV cache sized in memory, not in blocks.
ENGINE = engine_flags(num_kv_blocks=None, kv_cache_memory="256MiB", max_model_len=2048)
SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 4}'


@pytest.fixture(scope="module")
def cluster(smollm2_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("smol-logs")
    template = logs / "tools.jinja"
    template.write_text(SMOLLM2_TOOLS)  # SmolLM2's own, and tools in the Hermes format
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with running(logs) as c:
        start_disaggregated(
            c,
            smollm2_path,
            engine=ENGINE,
            capacity="256MiB",
            decode=["--speculative-config", SPECULATIVE],
            gateway=["--max-model-len", "2048", *tools, "--chat-template", str(template)],
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


@pytest.fixture(scope="module")
def engine(smollm2_path) -> LLM:
    """The in-process engine the cluster's answers are held to: the plain model, as the
    cluster's workers run it (``PDSERVE_ENFORCE_EAGER``); the compiled step's exactness is
    test_exactness_smollm2's."""
    return LLM(
        model=str(smollm2_path),
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory="256MiB",
        enforce_eager=True,
    )


def test_greedy_chat_equals_the_in_process_engine(client, engine):
    want = engine.chat(CHATS, SamplingParams(max_tokens=48, temperature=0))
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


def test_a_speculating_decode_worker_streams_what_the_engine_alone_gives(client, cluster, engine):
    """The prompt is prefilled by the prefill worker; the decode worker speculates on the
    imported request, and its stream is the text of an engine that does not speculate."""
    text = (
        "The committee approved the annual budget after a long discussion. The river "
        "rebuilt the northern road as planned. Every student visited a quiet garden "
        "before the winter began. My neighbour replaced a broken clock without any help."
    )
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}]
    want = engine.chat([messages], SamplingParams(max_tokens=80, temperature=0))[0]
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


MODEL = "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("name", list(MODELS))
def test_parse_returns_the_pydantic_object(client, name):
    """The SDK's parse (a strict json_schema response_format from a Pydantic model): every
    answer parses (bench.serving.structured runs 20 prompts a schema)."""
    for subject in SUBJECTS[:2]:
        question = PROMPTS[name].format(subject=subject)
        completion = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            response_format=MODELS[name],
            temperature=0,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, MODELS[name])


WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(client, **request) -> tuple[dict, str | None]:
    """The tool calls a stream's deltas assemble to (by index), and its finish reason."""
    calls, finish = {}, None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    return calls, finish


def _as_dicts(calls) -> dict:
    return {
        i: {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for i, c in enumerate(calls)
    }


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls_validate_and_stream_as_they_answer(client, tool_choice):
    request = dict(
        model=MODEL,
        messages=WEATHER,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=120,
    )
    choice = client.chat.completions.create(**request).choices[0]
    _check_calls(choice.message.tool_calls)
    if tool_choice == "required":
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.tool_calls[0].function.name == "get_weather"
    streamed, finish = _streamed_calls(client, **request)
    assert finish == choice.finish_reason
    unary = _as_dicts(choice.message.tool_calls)
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c["name"], c["arguments"]) for c in unary.values()
    ]


def test_auto_turns_a_hermes_tool_call_into_tool_calls(client):
    """tool_choice auto: the model's <tool_call> text (scripted here by a regex, the model
    filling in the city) becomes tool_calls, unary and streamed alike."""
    regex = (
        r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", '
        r'"unit": "celsius"\}\}\n</tool_call>'
    )
    request = dict(
        model=MODEL,
        messages=WEATHER,
        tools=TOOLS,
        temperature=0,
        max_tokens=80,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    choice = client.chat.completions.create(**request).choices[0]
    _check_calls(choice.message.tool_calls)
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    streamed, finish = _streamed_calls(client, **request)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    # Without a call in its text, auto answers with content.
    plain = client.chat.completions.create(
        model=MODEL, messages=WEATHER, tools=TOOLS, temperature=0, max_tokens=16
    ).choices[0]
    assert plain.message.content and not plain.message.tool_calls
