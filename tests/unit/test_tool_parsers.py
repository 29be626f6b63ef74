"""The tool call parsers (vLLM's names): whole outputs and streams, exact content and calls;
a stream's content and calls are the whole output's, however it is cut."""

from __future__ import annotations

import json

import pytest

from pdserve.gateway.tool_parsers import PARSERS, StreamParser, ToolCall, make_parser
from pdserve.settings.services import TOOL_CALL_PARSERS

HERMES_TWO = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n'
    '</tool_call><tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}'
    "</tool_call>"
)

CASES = [
    (
        "hermes",
        HERMES_TWO,
        "Let me check. ",
        [("get_weather", {"city": "Lyon"}), ("get_time", {"tz": "CET"})],
    ),
    ("hermes", "no call at all", "no call at all", []),
    ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    ("hermes", 'a <tool_call>{"name": "f", "arguments": {}}', "a ", [("f", {})]),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
        "",
        [("f", {"a": 1}), ("g", {})],
    ),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
    ("llama3_json", "Hello {not a call}", "Hello {not a call}", []),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', "", [("f", {"a": 1})]),
    (
        "pythonic",
        '[get_weather(city="Lyon", n=2), now()]',
        "",
        [("get_weather", {"city": "Lyon", "n": 2}), ("now", {})],
    ),
    ("pythonic", "[not valid python(", "[not valid python(", []),
]


def _calls(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_the_parsers_are_the_flags_choices():
    assert PARSERS == TOOL_CALL_PARSERS
    with pytest.raises(ValueError, match="unknown tool call parser"):
        make_parser("nope")


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_outputs(name, text, content, calls):
    got_content, got_calls = make_parser(name).parse(text)
    assert got_content == content and _calls(got_calls) == calls


@pytest.mark.parametrize("name, text, content, calls", CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_a_stream_gives_the_whole_outputs_content_and_calls(name, text, content, calls, piece):
    stream = StreamParser(make_parser(name))
    sent = "".join(stream.feed(text[i : i + piece]) for i in range(0, len(text), piece))
    rest, got_calls = stream.finish()
    assert sent + rest == content and _calls(got_calls) == calls


def test_text_before_a_marker_goes_out_as_it_comes_and_a_marker_prefix_waits():
    stream = StreamParser(make_parser("hermes"))
    assert stream.feed("Sure") == "Sure"
    assert stream.feed(". <too") == ". "  # "<too" may begin "<tool_call>"
    assert stream.feed("k> then <tool_") == "<took> then "
    assert stream.feed('call>{"name": "f", "arguments": {}}</tool_call>') == ""
    assert _calls(stream.finish()[1]) == [("f", {})]


def test_calls_get_openai_ids_and_shapes():
    call = ToolCall("f", "{}").with_id()
    assert call.id.startswith("call_") and call.with_id().id == call.id
    assert call.as_openai(2) == {
        "index": 2,
        "id": call.id,
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
