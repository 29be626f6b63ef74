"""OpenAI's response objects, whole or as SSE chunks, built from generation messages."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pdserve.core.finish_reason import FinishReason
from pdserve.core.tokenizer import Tokenizer
from pdserve.gateway.generation import REQUEST_ERRORS
from pdserve.gateway.openai_protocol import api_error_of
from pdserve.v1 import common_pb2, gateway_pb2


@dataclass(frozen=True)
class Reply:
    """Builds OpenAI's response objects (whole or as SSE chunks) from generation messages."""

    id: str
    model: str
    created: int
    chat: bool
    return_token_ids: bool
    tokenizer: Tokenizer | None = None  # set when logprobs were asked for

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs(
        self, lps: list[common_pb2.TokenLogprob], offset: int = 0
    ) -> dict[str, Any] | None:
        """OpenAI's logprobs object of a choice (chat or completions form), or None."""
        if self.tokenizer is None:
            return None
        if self.chat:
            content = []
            for lp in lps:
                token = self._token(lp.token_id)
                top = sorted(lp.top.items(), key=lambda kv: -kv[1])
                content.append(
                    {
                        "token": token,
                        "logprob": lp.logprob,
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {
                                "token": (t := self._token(i)),
                                "logprob": v,
                                "bytes": list(t.encode()),
                            }
                            for i, v in top
                        ],
                    }
                )
            return {"content": content}
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [
                {self._token(i): v for i, v in sorted(lp.top.items(), key=lambda kv: -kv[1])}
                for lp in lps
            ],
            "text_offset": offsets,
        }

    async def whole(
        self, chunks: AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]], n: int
    ) -> dict[str, Any]:
        texts: list[list[str]] = [[] for _ in range(n)]
        token_ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[common_pb2.TokenLogprob]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        usages: list[common_pb2.Usage] = []
        try:
            async with aclosing(chunks):
                async for index, chunk in chunks:
                    texts[index].append(chunk.text)
                    token_ids[index].extend(chunk.token_ids)
                    lps[index].extend(chunk.logprobs)
                    if chunk.finish_reason:
                        finish[index] = _finish_reason(chunk.finish_reason)
                        usages.append(chunk.usage)
        except REQUEST_ERRORS as error:
            raise api_error_of(error) from None
        choices = []
        for i in range(n):
            choice: dict[str, Any] = {
                "index": i,
                "logprobs": self.logprobs(lps[i]),
                "finish_reason": finish[i],
            }
            text = "".join(texts[i])
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if self.return_token_ids:
                choice["token_ids"] = token_ids[i]
            choices.append(choice)
        return {**self._head(), "choices": choices, "usage": _usage(usages)}

    async def sse(
        self,
        chunks: AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]],
        n: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        usages: list[common_pb2.Usage] = []
        try:
            if self.chat:
                for i in range(n):
                    yield _event(self._chunk(i, {"role": "assistant", "content": ""}, None))
            async with aclosing(chunks):
                async for index, chunk in chunks:
                    finish = _finish_reason(chunk.finish_reason) if chunk.finish_reason else None
                    if finish:
                        usages.append(chunk.usage)
                    elif not chunk.text and not self.return_token_ids and not chunk.logprobs:
                        continue  # tokens that complete no character yet
                    body = self._chunk(
                        index, {"content": chunk.text} if self.chat else chunk.text, finish
                    )
                    body["choices"][0]["logprobs"] = self.logprobs(list(chunk.logprobs))
                    if self.return_token_ids:
                        body["choices"][0]["token_ids"] = list(chunk.token_ids)
                    yield _event(body)
            if include_usage:
                yield _event({**self._head(chunk=True), "choices": [], "usage": _usage(usages)})
        except REQUEST_ERRORS as error:
            yield _event(api_error_of(error).body())
        yield "data: [DONE]\n\n"

    def _head(self, chunk: bool = False) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, index: int, delta: Any, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {**self._head(chunk=True), "choices": [choice]}


def _finish_reason(reason: str) -> str:
    """OpenAI's two reasons, from a message's ``finish_reason``: "length" when max_tokens ran
    out, else "stop" (EOS, stop token or string)."""
    return "length" if reason == FinishReason.LENGTH else "stop"


def _usage(usages: list[common_pb2.Usage]) -> dict[str, Any]:
    """The request's usage: the prompt counted once, the choices' completions summed."""
    prompt = usages[0].prompt_tokens if usages else 0
    completion = sum(u.completion_tokens for u in usages)
    cached = max((u.cached_prompt_tokens for u in usages), default=0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
