"""A greedy completion streamed through a gateway's REST API, its token ids collected."""

from __future__ import annotations

import asyncio
import json

import httpx


async def stream_greedy(
    client: httpx.AsyncClient,
    prompt: list[int],
    max_tokens: int,
    started: asyncio.Event,
    model: str = "tiny",
) -> list[int]:
    """The completion's token ids (greedy, EOS ignored); ``started`` is set once three have
    come."""
    tokens: list[int] = []
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens.extend(choice.get("token_ids") or [])
                if len(tokens) >= 3:
                    started.set()
    return tokens
