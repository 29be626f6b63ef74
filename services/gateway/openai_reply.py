"""OpenAI's text completion responses, whole or as SSE chunks, built from generation messages;
and what chat responses share with them (usage, token strings, logprob values).

Messages arrive as ``(choice index, GenerateResponse)``: new token ids, text and logprobs,
the first with the prompt's logprobs, the last with the finish reason, stop reason and usage.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pdserve.core.finish_reason import FinishReason
from pdserve.core.tokenizer import Tokenizer
from pdserve.gateway.generation import REQUEST_ERRORS
from pdserve.gateway.openai_errors import api_error_of
from pdserve.v1 import common_pb2, gateway_pb2

# What OpenAI's clients get instead of -inf (a token the mask ruled out).
MIN_LOGPROB = -9999.0

Chunks = AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]]


@dataclass(frozen=True)
class ChoiceInput:
    """What a reply knows of a choice before it runs: its prompt's ids and text."""

    prompt_token_ids: list[int]
    prompt_text: str | None = None


@dataclass(frozen=True)
class ReplyOptions:
    """The request's asks that shape its response."""

    id: str
    model: str
    created: int
    tokenizer: Tokenizer
    choices: list[ChoiceInput]
    n: int = 1  # choices per prompt: choice i * n + j is prompt i's
    top_logprobs: int | None = None  # None: no logprobs
    prompt_logprobs: bool = False  # the client asked for them (echo alone does not show them)
    echo: bool = False
    drop_output: bool = False  # max_tokens 0 with echo: the one token made is not shown
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    prompt_tokens_details: bool = False
    include_usage: bool = False
    continuous_usage: bool = False

    def token(self, token_id: int) -> str:
        """A token as a logprobs entry names it."""
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class ChoiceState:
    """A choice as its messages arrive."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: common_pb2.Usage | None = None

    def add(self, chunk: gateway_pb2.GenerateResponse) -> None:
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        if chunk.finish_reason:
            self.finish_reason = finish_reason(chunk.finish_reason)
            self.stop_reason = stop_reason(chunk)
            self.usage = chunk.usage


def finish_reason(reason: str) -> str:
    """OpenAI's two reasons, from a message's ``finish_reason``: "length" when max_tokens ran
    out, else "stop" (EOS, stop token or string)."""
    return "length" if reason == FinishReason.LENGTH else "stop"


def stop_reason(chunk: gateway_pb2.GenerateResponse) -> int | str | None:
    """vLLM's stop_reason: the stop string or token id that ended the choice (None: EOS or
    length)."""
    kind = chunk.WhichOneof("stop_reason")
    return None if kind is None else getattr(chunk, kind)


def logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def usage(
    options: ReplyOptions,
    states: list[ChoiceState],
    drop: bool = False,
    choice: ChoiceInput | None = None,
) -> dict[str, Any]:
    """The request's usage: each prompt counted once, the choices' completions summed;
    with ``choice``, that one choice's so far (a stream's continuous usage)."""
    inputs = [choice] if choice is not None else options.choices[:: options.n]
    prompt = sum(len(c.prompt_token_ids) for c in inputs)
    completion = 0 if drop else sum(len(s.token_ids) for s in states)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if options.prompt_tokens_details:
        cached = max((s.usage.cached_prompt_tokens for s in states if s.usage), default=0)
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def prompt_logprobs_json(
    options: ReplyOptions, prompt_ids: list[int], lps: list[common_pb2.TokenLogprob]
) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: None for the first token, then for each prompt token a dict
    of it and the top tokens at its position, by token id: logprob, rank, decoded_token."""
    out: list[dict[str, Any] | None] = [None]
    for token, lp in zip(prompt_ids[1:], lps, strict=False):
        entry = {str(token): _prompt_entry(options, token, lp.logprob, lp.rank or None)}
        ordered = sorted(lp.top.items(), key=lambda kv: -kv[1])
        for rank, (i, v) in enumerate(ordered, start=1):
            entry.setdefault(str(i), _prompt_entry(options, i, v, rank))
        out.append(entry)
    return out


def _prompt_entry(options: ReplyOptions, token: int, value: float, rank: int | None) -> dict:
    return {"logprob": logprob(value), "rank": rank, "decoded_token": options.token(token)}


def event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"


def error_event(error: Exception) -> str:
    return event(api_error_of(error).body())


DONE = "data: [DONE]\n\n"


# -- text completions --------------------------------------------------------------------


class CompletionReply:
    """/v1/completions responses."""

    def __init__(self, options: ReplyOptions) -> None:
        self.o = options

    def _head(self) -> dict[str, Any]:
        o = self.o
        return {"id": o.id, "object": "text_completion", "created": o.created, "model": o.model}

    def _logprobs(
        self,
        lps: list[common_pb2.TokenLogprob],
        offset: int,
        prompt: tuple[list[int], list[common_pb2.TokenLogprob]] | None = None,
    ) -> tuple[dict[str, Any] | None, int]:
        """The legacy logprobs object (tokens, their logprobs, each position's top tokens with
        the sampled or prompt token first, so k or k+1 entries, and the text offsets from
        ``offset``), and the offset after its tokens."""
        o = self.o
        if o.top_logprobs is None:
            return None, offset
        rows: list[tuple[int, float | None, dict[int, float] | None]] = []
        if prompt is not None:  # echo: the prompt's tokens first, the first without a logprob
            ids, plps = prompt
            rows.append((ids[0], None, None))
            rows += [(t, lp.logprob, dict(lp.top)) for t, lp in zip(ids[1:], plps, strict=False)]
        rows += [(lp.token_id, lp.logprob, dict(lp.top)) for lp in lps]
        tokens, values, tops, offsets = [], [], [], []
        for token_id, value, top in rows:
            text = o.token(token_id)
            tokens.append(text)
            values.append(None if value is None else logprob(value))
            offsets.append(offset)
            offset += len(o.tokenizer.decode([token_id], skip_special_tokens=False))
            if top is None:
                tops.append(None)
                continue
            entry = {text: logprob(value)}
            for i, v in sorted(top.items(), key=lambda kv: -kv[1])[: o.top_logprobs]:
                entry.setdefault(o.token(i), logprob(v))
            tops.append(entry)
        body = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops}
        return {**body, "text_offset": offsets}, offset

    def _echo_text(self, index: int) -> str:
        choice = self.o.choices[index]
        if choice.prompt_text is not None:
            return choice.prompt_text
        return self.o.tokenizer.decode(choice.prompt_token_ids, skip_special_tokens=False)

    def _choice(self, state: ChoiceState) -> dict[str, Any]:
        o = self.o
        prompt_ids = o.choices[state.index].prompt_token_ids
        text = "".join(state.text)
        lps, token_ids = state.logprobs, state.token_ids
        if o.drop_output:
            text, lps, token_ids = "", [], []
        echo = (prompt_ids, state.prompt_logprobs) if o.echo else None
        if o.echo:
            text = self._echo_text(state.index) + text
        return {
            "index": state.index,
            "text": text,
            "logprobs": self._logprobs(lps, 0, echo)[0],
            "finish_reason": "length" if o.drop_output else state.finish_reason,
            "stop_reason": None if o.drop_output else state.stop_reason,
            "prompt_logprobs": self._prompt_logprobs(state),
            "prompt_token_ids": prompt_ids if o.return_token_ids else None,
            "token_ids": token_ids if o.return_token_ids else None,
        }

    def _prompt_logprobs(self, state: ChoiceState) -> list | None:
        if not self.o.prompt_logprobs:
            return None
        prompt_ids = self.o.choices[state.index].prompt_token_ids
        return prompt_logprobs_json(self.o, prompt_ids, state.prompt_logprobs)

    async def whole(self, chunks: Chunks) -> dict[str, Any]:
        states = await collect(chunks, len(self.o.choices))
        return {
            **self._head(),
            "choices": [self._choice(s) for s in states],
            "usage": usage(self.o, states, self.o.drop_output),
        }

    def sse(self, chunks: Chunks) -> AsyncIterator[str]:
        o = self.o
        streams = [StreamState() for _ in o.choices]

        def tail(states: list[ChoiceState]) -> dict[str, Any] | None:
            if not o.include_usage:
                return None
            return {**self._head(), "choices": [], "usage": usage(o, states, o.drop_output)}

        return sse_events(
            chunks,
            len(o.choices),
            lambda states, i, chunk: self._chunk(states, streams[i], i, chunk),
            tail,
        )

    def _chunk(
        self,
        states: list[ChoiceState],
        stream: StreamState,
        index: int,
        chunk: gateway_pb2.GenerateResponse,
    ) -> dict[str, Any] | None:
        """A choice's next SSE chunk, or None while its tokens complete no character (their
        ids and logprobs wait for the chunk whose text they make, unless the client asked
        for token ids)."""
        o, state = self.o, states[index]
        text = "" if o.drop_output else chunk.text
        if not o.drop_output:
            stream.hold(chunk)
        echo = None
        if not stream.started and o.echo:
            prompt_ids = o.choices[index].prompt_token_ids
            echo = (prompt_ids, list(chunk.prompt_logprobs))
            text = self._echo_text(index) + text
        finish = state.finish_reason
        # With token ids asked for, every message's tokens go out at once, text or not.
        if not (text or finish or echo or (o.return_token_ids and stream.ids)):
            return None
        first = not stream.started
        stream.started = True
        ids, lps = stream.take()
        logprobs, stream.offset = self._logprobs(lps, stream.offset, echo)
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": "length" if o.drop_output and finish else finish,
            "stop_reason": None if o.drop_output else state.stop_reason,
        }
        if o.return_token_ids:
            choice["token_ids"] = ids
            if first:
                choice["prompt_token_ids"] = o.choices[index].prompt_token_ids
        body = {**self._head(), "choices": [choice]}
        if o.continuous_usage:
            body["usage"] = usage(o, [state], o.drop_output, o.choices[index])
        return body


@dataclass
class StreamState:
    """What a streamed choice has sent, and the tokens waiting for their text."""

    started: bool = False
    offset: int = 0  # text_offset of the next token
    ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)

    def hold(self, chunk: gateway_pb2.GenerateResponse) -> None:
        self.ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)

    def take(self) -> tuple[list[int], list[common_pb2.TokenLogprob]]:
        out = self.ids, self.logprobs
        self.ids, self.logprobs = [], []
        return out


async def sse_events(
    chunks: Chunks,
    n: int,
    make_chunk: Callable[[list[ChoiceState], int, gateway_pb2.GenerateResponse], dict | None],
    tail: Callable[[list[ChoiceState]], dict | None],
    opening: Callable[[list[ChoiceState]], list[dict]] = lambda states: [],
) -> AsyncIterator[str]:
    """A reply's SSE events: ``opening``'s, then ``make_chunk``'s body for each message (None:
    nothing to send yet), then ``tail``'s; a request error as an error event; then [DONE]."""
    states = [ChoiceState(i) for i in range(n)]
    try:
        for body in opening(states):
            yield event(body)
        async with aclosing(chunks):
            async for index, chunk in chunks:
                states[index].add(chunk)
                body = make_chunk(states, index, chunk)
                if body is not None:
                    yield event(body)
        last = tail(states)
        if last is not None:
            yield event(last)
    except REQUEST_ERRORS as error:
        yield error_event(error)
    yield DONE


async def collect(chunks: Chunks, n: int) -> list[ChoiceState]:
    """Every choice's state once all messages are in; a request error as its APIError."""
    states = [ChoiceState(i) for i in range(n)]
    try:
        async with aclosing(chunks):
            async for index, chunk in chunks:
                states[index].add(chunk)
    except REQUEST_ERRORS as error:
        raise api_error_of(error) from None
    return states
