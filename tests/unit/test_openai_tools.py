"""The grammar that enforces tool_choice "required" (gateway/openai_tools.py): the schema a
list of calls must fit, with each tool's ``$defs`` reachable from its root."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.engine.structured_output import GrammarCompiler
from pdserve.gateway.openai_errors import APIError
from pdserve.gateway.openai_protocol import ChatCompletionRequest
from pdserve.gateway.openai_tools import tool_constraint, tool_mode

# A function whose parameters refer to a definition (pydantic's shape for a nested model).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "options": {"$ref": "#/$defs/Options"}},
            "required": ["city", "options"],
            "$defs": {
                "Options": {
                    "type": "object",
                    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["unit"],
                }
            },
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def required_schema(*tools) -> dict:
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tools=list(tools), tool_choice="required"
    )
    return json.loads(tool_constraint(body, tool_mode(body, None, False)).json)


def test_required_hoists_each_tools_defs_to_the_root():
    schema = required_schema(WEATHER, TIME)
    assert schema["$defs"] == WEATHER["function"]["parameters"]["$defs"]
    good = [{"name": "get_weather", "parameters": {"city": "Lyon", "options": {"unit": "celsius"}}}]
    jsonschema.validate(good, schema)  # the $ref resolves against the root
    bad = [{"name": "get_weather", "parameters": {"city": "Lyon", "options": {"unit": "K"}}}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_the_required_schema_compiles(tiny_llama_path):
    """xgrammar resolves the hoisted $ref (it refused the nested one: "Cannot find field
    '$defs' in #/$defs/Options")."""
    from pdserve.testing.tiny_models import TINY_VOCAB

    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, TIME], tool_choice="required"
    )
    GrammarCompiler(tiny_llama_path, TINY_VOCAB, [2]).compile(
        tool_constraint(body, tool_mode(body, None, False))
    )


def test_two_tools_defining_one_name_differently_are_a_400():
    other = json.loads(json.dumps(TIME))
    other["function"]["parameters"]["$defs"] = {"Options": {"type": "string"}}
    with pytest.raises(APIError) as error:
        required_schema(WEATHER, other)
    assert error.value.status == 400 and "Options" in str(error.value)
