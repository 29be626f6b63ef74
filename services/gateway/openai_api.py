"""The gateway's OpenAI-compatible REST front: chat and text completions, models, health.

A REST request becomes a ``GenerateRequest`` and goes through the same ``prepare`` and
``generation.generate`` as a gRPC call; this module only translates shapes and errors.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from services.common.pb import common_pb2, gateway_pb2
from services.gateway.generation import REQUEST_ERRORS, generate_many
from services.gateway.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    api_error_of,
    validation_message,
)
from services.gateway.orchestrator import Orchestrator
from services.gateway.requests import InvalidRequest, ModelLimits, PreparedRequest, prepare

REQUEST_ID_HEADER = "x-request-id"

# -- the app -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """What the REST handlers run on: the orchestrator, tokenizer, limits and model name."""

    orchestrator: Orchestrator
    tokenizer: Any
    limits: ModelLimits
    model_name: str


def create_app(served: Served) -> FastAPI:
    """The FastAPI app of the OpenAI REST API over ``served``."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = validation_message(error)
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, error: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        body = APIError(error.status_code, str(error.detail), kind).body()
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": served.limits.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        messages = [gateway_pb2.ChatMessage(role=m.role, content=m.text()) for m in body.messages]
        proto = gateway_pb2.GenerateRequest(messages=gateway_pb2.ChatMessages(messages=messages))
        return await _complete(served, body, proto, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if isinstance(body.prompt, str):
            proto = gateway_pb2.GenerateRequest(prompt=body.prompt)
        else:
            proto = gateway_pb2.GenerateRequest(
                prompt_token_ids=gateway_pb2.TokenIds(ids=body.prompt)
            )
        return await _complete(served, body, proto, request, chat=False)

    return app


class RequestIdMiddleware:
    """Takes the request id from ``x-request-id`` (or makes one) and echoes it on the response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        value = headers.get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1").strip()
        request_id = value or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [
                    *message["headers"],
                    (REQUEST_ID_HEADER.encode(), request_id.encode("latin-1")),
                ]
            await send(message)

        await self.app(scope, receive, send_with_id)


# -- completions -------------------------------------------------------------------------


async def _complete(
    served: Served,
    body: ChatCompletionRequest | CompletionRequest,
    proto: gateway_pb2.GenerateRequest,
    request: Request,
    chat: bool,
) -> Response:
    if body.model != served.model_name:
        raise APIError(
            404,
            f"The model `{body.model}` does not exist; this server serves `{served.model_name}`.",
            param="model",
            code="model_not_found",
        )
    request_id = request.state.request_id
    requests = _prepare_choices(served, body, proto, request_id)
    reply = _Reply(
        id=f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        model=served.model_name,
        created=int(time.time()),
        chat=chat,
        return_token_ids=body.return_token_ids,
    )
    chunks = generate_many(served.orchestrator, served.tokenizer, requests)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            reply.sse(chunks, len(requests), include_usage), media_type="text/event-stream"
        )
    result = await _unless_disconnected(request, reply.whole(chunks, len(requests)))
    return JSONResponse(result)


def _prepare_choices(
    served: Served,
    body: ChatCompletionRequest | CompletionRequest,
    proto: gateway_pb2.GenerateRequest,
    request_id: str,
) -> list[PreparedRequest]:
    """One prepared request per choice; a seeded choice i samples with seed + i."""
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    try:
        proto.params.CopyFrom(
            common_pb2.SamplingParams(
                max_tokens=max_tokens or 0,  # 0: the gateway's default
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=body.top_k or 0,
                top_p=body.top_p or 0,
                min_p=body.min_p or 0,
                ignore_eos=body.ignore_eos,
            )
        )
        if body.seed is not None:
            proto.params.seed = body.seed
        proto.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop or [])
    except ValueError as error:  # a value outside the proto's range
        raise APIError(400, f"a parameter is out of range: {error}") from None
    proto.request_id = f"{request_id}-0"
    try:
        first = prepare(proto, served.tokenizer, served.limits)
    except InvalidRequest as error:
        raise APIError(400, str(error), param=_param_of(str(error), body)) from None
    choices = [first]
    for i in range(1, body.n):
        params = common_pb2.SamplingParams()
        params.CopyFrom(first.params)
        if body.seed is not None:
            params.seed = body.seed + i
        choices.append(replace(first, request_id=f"{request_id}-{i}", params=params))
    return choices


def _param_of(message: str, body: BaseModel) -> str | None:
    """The field an InvalidRequest names first ("temperature must be ..."), if it is a field."""
    word = message.split(maxsplit=1)[0] if message else ""
    return word if word in type(body).model_fields else None


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result, cancelling it (and so its generations) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return {}  # nobody is listening
    return task.result()


@dataclass(frozen=True)
class _Reply:
    """Builds OpenAI's response objects (whole or as SSE chunks) from generation messages."""

    id: str
    model: str
    created: int
    chat: bool
    return_token_ids: bool

    async def whole(
        self, chunks: AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]], n: int
    ) -> dict[str, Any]:
        texts: list[list[str]] = [[] for _ in range(n)]
        token_ids: list[list[int]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        usages: list[common_pb2.Usage] = []
        try:
            async with aclosing(chunks):
                async for index, chunk in chunks:
                    texts[index].append(chunk.text)
                    token_ids[index].extend(chunk.token_ids)
                    if chunk.finish_reason:
                        finish[index] = _finish_reason(chunk.finish_reason)
                        usages.append(chunk.usage)
        except REQUEST_ERRORS as error:
            raise api_error_of(error) from None
        choices = []
        for i in range(n):
            choice: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": finish[i]}
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
                    elif not chunk.text and not self.return_token_ids:
                        continue  # tokens that complete no character yet
                    body = self._chunk(
                        index, {"content": chunk.text} if self.chat else chunk.text, finish
                    )
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
    """OpenAI's two reasons: "length" when max_tokens ran out, else "stop" (EOS, stop token or string)."""
    return "length" if reason == "length" else "stop"


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
