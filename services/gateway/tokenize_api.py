"""vLLM's tokenizer endpoints on the REST front: POST /tokenize (a prompt, or chat messages
through the template), POST /detokenize, and GET /tokenizer_info (with
``--enable-tokenizer-info-endpoint``). They run in the gateway alone: no worker is called."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pdserve.core.tokenizer import ChatTemplateError
from pdserve.gateway.openai_errors import APIError, bad_request, error_responses
from pdserve.gateway.openai_params import template_message
from pdserve.gateway.openai_protocol import DetokenizeRequest, TokenizeRequest


def add_tokenize_routes(app: FastAPI, served: Any, check_model, check_fields) -> None:
    """Add the endpoints to ``app``; ``check_model`` and ``check_fields`` are the handlers'
    own checks of the model name and of unknown fields."""

    errors = error_responses(400, 404, 413, 500)

    @app.post("/tokenize", responses=errors)
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        check_model(body.model)
        check_fields(body)
        ids = await asyncio.to_thread(_tokenize, served, body)
        strs = served.tokenizer.token_strs(ids) if body.return_token_strs else None
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": served.limits.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    @app.post("/detokenize", responses=errors)
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        check_model(body.model)
        check_fields(body)
        vocab = served.limits.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of vocabulary (vocab size {vocab})", "tokens")
        text = served.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    if served.openai.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> JSONResponse:
            return JSONResponse(served.tokenizer.info())


def _tokenize(served: Any, body: TokenizeRequest) -> list[int]:
    tokenizer = served.tokenizer
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return tokenizer.encode(body.prompt, add_special_tokens=add_special)
    messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    tools = [t.model_dump(exclude_unset=True, by_alias=True) for t in body.tools or []]
    try:
        text = tokenizer.render_chat(
            messages,
            body.add_generation_prompt,
            tools=tools or None,
            continue_final_message=body.continue_final_message,
            **(body.chat_template_kwargs or {}),
        )
    except (ChatTemplateError, TypeError) as error:
        raise APIError(
            400, f"the chat template refused the messages: {error}", param="messages"
        ) from None
    return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
