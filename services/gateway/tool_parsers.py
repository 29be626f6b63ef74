"""Tool calls in a model's text, parsed as vLLM's ``--tool-call-parser`` names do: ``hermes``
(``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), ``llama3_json`` (a JSON object
``{"name": ..., "parameters": ...}``, or several separated by ``;``, after an optional
``<|python_tag|>``), ``mistral`` (``[TOOL_CALLS]`` and a JSON list) and ``pythonic``
(``[get_weather(city="Lyon"), ...]``).

A parser reads the whole output (``parse``), or a stream (``StreamParser``): text that cannot
be part of a tool call goes out as content at once; from where a call may begin the text is
held, and each call goes out once it is complete, its arguments whole. A call that does not
parse is given back as content, as vLLM does.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def with_id(self) -> ToolCall:
        return ToolCall(self.name, self.arguments, self.id or new_call_id())

    def as_openai(self, index: int | None = None) -> dict:
        """OpenAI's ``tool_calls`` entry (a stream's delta carries ``index``)."""
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    """A tool call id in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments(value: object) -> str | None:
    """Arguments as JSON text (a model may write them as an object or as a string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call(obj: object, args_key: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_key:
        if key in obj:
            arguments = _arguments(obj[key])
            return None if arguments is None else ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], "{}")


class ToolParser:
    """Splits a model's whole output into content and tool calls."""

    name = ""

    def start(self, text: str) -> int | None:
        """Where in ``text`` tool calls may begin (None: nowhere yet)."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output; no calls when they do not parse."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def start(self, text: str) -> int | None:
        return _marker(text, self.START)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.START)
        if at < 0:
            return text, []
        calls = []
        for closed, unclosed in self._CALL.findall(text[at:]):
            try:
                call = _call(json.loads(closed or unclosed))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:at], calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        stripped = len(text) - len(text.lstrip())
        rest = text[stripped:]
        if rest.startswith(("{", self.TAG)) or (rest and self.TAG.startswith(rest)):
            return 0  # leading whitespace held too: a call's output has no content
        return None if rest else 0

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = _call(obj)
            if call is None:
                return text, []
            calls.append(call)
            at = end
            rest = body[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return text, []
            at = len(body) - len(rest)
        return "", calls


class MistralParser(ToolParser):
    name = "mistral"
    TAG = "[TOOL_CALLS]"

    def start(self, text: str) -> int | None:
        return _marker(text, self.TAG)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.TAG)
        if at < 0:
            return text, []
        try:
            items = json.loads(text[at + len(self.TAG) :].strip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call(item) for item in items]
        if not calls or None in calls:
            return text, []
        return text[:at], calls


class PythonicParser(ToolParser):
    name = "pythonic"

    def start(self, text: str) -> int | None:
        if text.lstrip().startswith("["):
            return 0
        return None if text.strip() else 0

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                return text, []
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return text, []
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return "", calls


def _marker(text: str, marker: str) -> int | None:
    """Where ``marker`` begins in ``text``, or where a prefix of it ends ``text``."""
    at = text.find(marker)
    if at >= 0:
        return at
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return None


def make_parser(name: str) -> ToolParser:
    """The parser vLLM calls ``name``."""
    classes = {c.name: c for c in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)}
    if name not in classes:
        raise ValueError(f"unknown tool call parser {name!r}: one of {', '.join(PARSERS)}")
    return classes[name]()


class StreamParser:
    """A streamed output through a parser: ``feed`` returns the content that is sure to be
    content now; ``finish`` the rest of the content and the calls."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._text = ""
        self._sent = 0  # characters of _text sent as content

    def feed(self, delta: str) -> str:
        self._text += delta
        # From where a call may begin (a marker, or a prefix of one at the end that may
        # still turn out to be text), the text is held.
        start = self.parser.start(self._text[self._sent :])
        end = len(self._text) if start is None else self._sent + start
        out, self._sent = self._text[self._sent : end], end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls) once the output is complete."""
        content, calls = self.parser.parse(self._text)
        if not calls:
            return self._text[self._sent :], []
        return content[self._sent :] if len(content) > self._sent else "", calls
