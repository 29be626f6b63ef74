"""OpenAI's chat completion responses, whole or as SSE chunks, with tool calls.

A stream starts each choice with a role chunk, then sends its content as it comes; its last
token's chunk carries the finish reason. Tool calls (``openai_tools``) go out as OpenAI's
``tool_calls`` deltas: a named function's arguments as they are generated (its id and name
first), the calls of ``required`` and of a parsed ``auto`` output once complete, each with
its arguments whole. Their concatenation is the unary answer's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pdserve.gateway.openai_reply import (
    ChoiceState,
    Chunks,
    ReplyOptions,
    StreamState,
    collect,
    logprob,
    prompt_logprobs_json,
    sse_events,
    usage,
)
from pdserve.gateway.openai_tools import ToolMode, call_of_named, calls_of_required
from pdserve.gateway.tool_parsers import StreamParser, ToolCall, new_call_id
from pdserve.v1 import common_pb2, gateway_pb2


@dataclass(frozen=True)
class ChatOptions:
    """What a chat reply adds to the shared options."""

    tools: ToolMode = field(default_factory=lambda: ToolMode("none"))
    echo_text: str = ""  # echo: the last message's content, when it is the assistant's


class ChatReply:
    """/v1/chat/completions responses."""

    def __init__(self, options: ReplyOptions, chat: ChatOptions) -> None:
        self.o = options
        self.chat = chat

    def _head(self, chunk: bool = False) -> dict[str, Any]:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.o.id, "object": kind, "created": self.o.created, "model": self.o.model}

    def _logprobs(self, lps: list[common_pb2.TokenLogprob]) -> dict[str, Any] | None:
        """The chat logprobs object: each token with its top ``top_logprobs`` tokens."""
        o = self.o
        if o.top_logprobs is None:
            return None
        content = []
        for lp in lps:
            top = sorted(lp.top.items(), key=lambda kv: -kv[1])[: o.top_logprobs]
            content.append(
                {
                    **self._entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self._entry(i, v) for i, v in top],
                }
            )
        return {"content": content}

    def _entry(self, token_id: int, value: float) -> dict[str, Any]:
        token = self.o.token(token_id)
        raw = self.o.tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob(value), "bytes": list(raw.encode())}

    def _message(self, state: ChoiceState) -> tuple[dict[str, Any], str | None]:
        """The choice's message and finish reason, tool calls parsed out of its text."""
        text = "".join(state.text)
        content, calls = text, []
        mode = self.chat.tools
        if mode.kind == "auto":
            content, calls = mode.parser.parse(text)
            calls = [c.with_id() for c in calls]
        elif mode.kind == "required":
            calls = calls_of_required(text)
        elif mode.kind == "named":
            calls = call_of_named(mode.name, text)
        if calls and mode.kind != "auto":
            content = ""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.chat.echo_text + content if content or not calls else None,
            "refusal": None,
        }
        finish = state.finish_reason
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
            if mode.kind in ("auto", "required") and finish == "stop":
                finish = "tool_calls"
        return message, finish

    async def whole(self, chunks: Chunks) -> dict[str, Any]:
        o = self.o
        states = await collect(chunks, len(o.choices))
        choices = []
        for state in states:
            message, finish = self._message(state)
            choice = {
                "index": state.index,
                "message": message,
                "logprobs": self._logprobs(state.logprobs),
                "finish_reason": finish,
                "stop_reason": state.stop_reason,
            }
            if o.return_token_ids:
                choice["token_ids"] = state.token_ids
            choices.append(choice)
        body = {**self._head(), "choices": choices, "usage": usage(o, states)}
        first = o.choices[0].prompt_token_ids
        body["prompt_token_ids"] = first if o.return_token_ids else None
        body["prompt_logprobs"] = (
            prompt_logprobs_json(o, first, states[0].prompt_logprobs) if o.prompt_logprobs else None
        )
        return body

    def sse(self, chunks: Chunks) -> AsyncIterator[str]:
        o = self.o
        streams = [ChatStream(self.chat.tools) for _ in o.choices]

        def opening(states: list[ChoiceState]) -> list[dict[str, Any]]:
            return [body for i in range(len(states)) for body in self._opening(states, i)]

        def tail(states: list[ChoiceState]) -> dict[str, Any] | None:
            if not o.include_usage:
                return None
            return {**self._head(True), "choices": [], "usage": usage(o, states)}

        return sse_events(
            chunks,
            len(o.choices),
            lambda states, i, chunk: self._chunk(states, streams[i], i, chunk),
            tail,
            opening,
        )

    def _opening(self, states: list[ChoiceState], index: int) -> list[dict[str, Any]]:
        """A choice's role chunk (and its echoed content)."""
        o = self.o
        role = self._body(index, {"role": "assistant", "content": ""}, None, None)
        if o.return_token_ids:
            role["prompt_token_ids"] = o.choices[index].prompt_token_ids
        if o.continuous_usage:
            role["usage"] = usage(o, [states[index]], choice=o.choices[index])
        out = [role]
        if self.chat.echo_text:
            out.append(self._body(index, {"content": self.chat.echo_text}, None, None))
        return out

    def _body(
        self, index: int, delta: dict[str, Any], logprobs: Any, finish: str | None
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}

    def _chunk(
        self,
        states: list[ChoiceState],
        stream: ChatStream,
        index: int,
        chunk: gateway_pb2.GenerateResponse,
    ) -> dict[str, Any] | None:
        o, state = self.o, states[index]
        stream.hold(chunk)
        delta = stream.delta(chunk.text)
        finish = state.finish_reason
        if finish is not None:
            finish = stream.finish(delta, finish)
        if not delta and finish is None and not (o.return_token_ids and stream.ids):
            return None  # no character yet: the tokens wait for the next chunk
        ids, lps = stream.take()
        body = self._body(index, delta, self._logprobs(lps) if lps or delta else None, finish)
        if o.return_token_ids:
            body["choices"][0]["token_ids"] = ids
        if finish is not None:
            body["choices"][0]["stop_reason"] = state.stop_reason
        if o.continuous_usage:
            body["usage"] = usage(o, [state], choice=o.choices[index])
        return body


class ChatStream(StreamState):
    """A streamed chat choice: its content, or its tool calls as they can be sent."""

    def __init__(self, mode: ToolMode) -> None:
        super().__init__()
        self.mode = mode
        self.parser = StreamParser(mode.parser) if mode.kind == "auto" else None
        self.text: list[str] = []
        self.named_id = new_call_id() if mode.kind == "named" else None

    def delta(self, text: str) -> dict[str, Any]:
        """What this text adds to the message now."""
        self.text.append(text)
        mode = self.mode
        if mode.kind == "none":
            return {"content": text} if text else {}
        if mode.kind == "auto":
            content = self.parser.feed(text)
            return {"content": content} if content else {}
        if mode.kind == "named":
            if not text:
                return {}
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if self.named_id is not None:  # the call's first delta: its id and name
                call = {
                    "index": 0,
                    "id": self.named_id,
                    "type": "function",
                    "function": {"name": mode.name, "arguments": text},
                }
                self.named_id = None
            return {"tool_calls": [call]}
        return {}  # required: sent whole at the end

    def finish(self, delta: dict[str, Any], finish: str) -> str:
        """Complete ``delta`` with what waited for the end; the choice's finish reason."""
        mode = self.mode
        calls: list[ToolCall] = []
        if mode.kind == "auto":
            rest, calls = self.parser.finish()
            calls = [c.with_id() for c in calls]
            if rest:
                delta["content"] = delta.get("content", "") + rest
        elif mode.kind == "required":
            calls = calls_of_required("".join(self.text))
            if not calls and "".join(self.text):  # cut short: the text as it is
                delta["content"] = "".join(self.text)
        if calls:
            delta["tool_calls"] = [c.as_openai(i) for i, c in enumerate(calls)]
            if finish == "stop":
                return "tool_calls"
        return finish
