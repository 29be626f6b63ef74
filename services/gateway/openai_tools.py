"""Tool calling on the chat API: which tools a request may call and how they are enforced.

``tool_choice`` ``none`` sends the tools to the template only; ``auto`` (the default when
tools are sent) lets the model call them in its own format, parsed by ``--tool-call-parser``;
``required`` and a named function are enforced with a grammar, as vLLM does: ``required``
makes the output a JSON array of ``{"name", "parameters"}`` objects, one of the tools each
(one only with ``parallel_tool_calls: false``), and a named function makes the output that
function's arguments. So their arguments always validate against the function's schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.core.sampling import StructuredOutputs
from pdserve.gateway.openai_errors import bad_request
from pdserve.gateway.openai_protocol import ChatCompletionRequest, NamedToolChoice
from pdserve.gateway.tool_parsers import ToolCall, ToolParser, make_parser

# A function that declares no parameters takes an object of anything.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolMode:
    """How a request's output becomes tool calls: ``kind`` is none, auto, required or named
    (``name`` the function); ``parser`` reads auto's output."""

    kind: str
    name: str | None = None
    parser: ToolParser | None = None

    @property
    def constrained(self) -> bool:
        return self.kind in ("required", "named")


def tool_mode(body: ChatCompletionRequest, parser_name: str | None, auto_enabled: bool) -> ToolMode:
    """The request's tool mode; a 400 for a tool_choice that does not fit its tools or the
    gateway's flags (vLLM's rules)."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if isinstance(choice, NamedToolChoice):
            raise bad_request(
                "tool_choice names a function, but the request has no tools", param="tool_choice"
            )
        if choice in ("auto", "required") and body.tools is None:
            raise bad_request(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return ToolMode("none")  # as OpenAI: an empty tools list is no tools
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("two tools have the same function name", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names the function {choice.function.name!r}, which is not one "
                f"of the tools ({', '.join(names)})",
                param="tool_choice",
            )
        if body.structured_outputs is not None or _json_response(body):
            raise bad_request(
                "a named tool_choice and structured_outputs (or a JSON response_format) "
                "cannot be combined: the function's arguments are the output",
                param="tool_choice",
            )
        return ToolMode("named", choice.function.name)
    kind = choice or "auto"
    if kind == "auto":
        if not auto_enabled:
            raise bad_request(
                'tool_choice "auto" (the default with tools) needs the gateway started with '
                "--enable-auto-tool-choice and --tool-call-parser; send tool_choice "
                '"required", a named function, or "none"',
                param="tool_choice",
            )
        return ToolMode("auto", parser=make_parser(parser_name))
    if kind == "required" and (body.structured_outputs is not None or _json_response(body)):
        raise bad_request(
            'tool_choice "required" and structured_outputs (or a JSON response_format) cannot '
            "be combined",
            param="tool_choice",
        )
    return ToolMode(kind)


def _json_response(body: ChatCompletionRequest) -> bool:
    return body.response_format is not None and body.response_format.type != "text"


def tool_constraint(body: ChatCompletionRequest, mode: ToolMode) -> StructuredOutputs | None:
    """The grammar that enforces ``required`` or a named function, else None."""
    functions = {t.function.name: t.function for t in body.tools or []}
    if mode.kind == "named":
        schema = functions[mode.name].parameters or _ANY_OBJECT
        return StructuredOutputs(json=json.dumps(schema))
    if mode.kind != "required":
        return None
    defs: dict[str, Any] = {}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": _hoist_defs(name, f.parameters or _ANY_OBJECT, defs),
            },
            "required": ["name", "parameters"],
        }
        for name, f in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutputs(json=json.dumps(schema))


def _hoist_defs(name: str, parameters: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` without its ``$defs``, which join ``defs``: nested in the array of
    calls, a ``$ref`` such as ``#/$defs/X`` resolves against the root. Two tools that define
    one name differently are a 400."""
    own = parameters.get("$defs")
    if not isinstance(own, dict):
        return parameters
    for key, definition in own.items():
        if key in defs and defs[key] != definition:
            raise bad_request(
                f"the tools define $defs/{key} differently (function {name!r} and another); "
                "give the definitions distinct names",
                param="tools",
            )
        defs[key] = definition
    return {k: v for k, v in parameters.items() if k != "$defs"}


def calls_of_required(text: str) -> list[ToolCall]:
    """The calls of a ``required`` output (a JSON array of {"name", "parameters"}); none
    when it was cut short (max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [
        ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)).with_id()
        for item in items
    ]


def call_of_named(name: str, text: str) -> list[ToolCall]:
    """The call of a named function's output (its arguments); none when cut short."""
    try:
        json.loads(text)
    except ValueError:
        return []
    return [ToolCall(name, text).with_id()]


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template sees them (as the client sent them)."""
    if not body.tools:
        return None
    return [t.model_dump(exclude_unset=True, by_alias=True) for t in body.tools]
