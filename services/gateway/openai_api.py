"""The gateway's OpenAI-compatible REST front: chat and text completions, models, health.

A REST request becomes a ``GenerateRequest`` and goes through the same ``prepare`` and
``generation.generate`` as a gRPC call; this module only translates shapes and errors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from pdserve.core.tokenizer import Tokenizer
from pdserve.gateway.admission import Admission, Overloaded
from pdserve.gateway.generation import REQUEST_ERRORS, generate_many
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
)
from pdserve.gateway.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    api_error_of,
    validation_message,
)
from pdserve.gateway.openai_reply import Reply
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.requests import (
    InvalidRequest,
    ModelLimits,
    PreparedRequest,
    check_prompt_length,
    prepare,
)
from pdserve.gateway.telemetry import RequestTelemetry, request_attributes
from pdserve.runtime import tracing
from pdserve.runtime.metrics import CONTENT_TYPE, exposition
from pdserve.v1 import common_pb2, gateway_pb2

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what an overloaded or workerless gateway asks a client to wait

# -- the app -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """What the REST handlers run on: the orchestrator, tokenizer, limits and model name,
    and the front's guards: the API key (None: open), body size and admission bounds."""

    orchestrator: Orchestrator
    tokenizer: Tokenizer
    limits: ModelLimits
    model_name: str
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 4 << 20
    admission: Admission = field(default_factory=lambda: Admission(256, 512, 30.0))
    send_timeout_s: float = 30.0
    metrics: GatewayMetrics | None = None  # None: a registry of this app's own


def create_app(served: Served) -> FastAPI:
    """The FastAPI app of the OpenAI REST API over ``served``."""
    registry = served.metrics or GatewayMetrics(
        served.model_name, served.limits.max_model_len, served.admission, served.orchestrator
    )
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    # The last added runs first: ids on every answer, then the key, then the body's size.
    app.add_middleware(BodyLimitMiddleware, max_bytes=served.max_body_bytes)
    if served.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=served.api_key)
    app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(Overloaded)
    async def _overloaded(_: Request, error: Overloaded) -> JSONResponse:
        return _error_response(APIError(429, str(error), "rate_limit_error", code="overloaded"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = validation_message(error)
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, error: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        body = APIError(error.status_code, str(error.detail), kind).body()
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def _bug(_: Request, error: Exception) -> JSONResponse:
        # Starlette logs the traceback after this; the client still gets OpenAI's shape.
        body = APIError(500, f"internal error in the gateway: {error!r}", "server_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text: requests, admission state, routing counters, the process."""
        return Response(exposition(registry.registry), media_type=CONTENT_TYPE)

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
        return await _complete(served, registry, body, proto, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if isinstance(body.prompt, str):
            proto = gateway_pb2.GenerateRequest(prompt=body.prompt)
        else:
            try:  # before the ids are copied into a message
                check_prompt_length(len(body.prompt), served.limits)
            except InvalidRequest as error:
                raise APIError(400, str(error), param="prompt") from None
            try:
                ids = gateway_pb2.TokenIds(ids=body.prompt)
            except ValueError:  # past the proto's uint32; prepare names the vocabulary size
                raise APIError(400, "prompt: a token id is out of range", param="prompt") from None
            proto = gateway_pb2.GenerateRequest(prompt_token_ids=ids)
        return await _complete(served, registry, body, proto, request, chat=False)

    return app


def _error_response(error: APIError) -> JSONResponse:
    """``error`` as JSON; an overloaded or unavailable gateway says when to retry."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


# -- completions -------------------------------------------------------------------------


async def _complete(
    served: Served,
    metrics: GatewayMetrics,
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
    proto.request_id = request.state.client_request_id
    telemetry = RequestTelemetry(
        metrics,
        tracing.from_headers(request.headers),
        arrival=request.state.arrival,
        arrival_ns=request.state.arrival_ns,
        attributes=request_attributes(
            request_id, served.model_name, request.state.client_request_id, request.url.path
        ),
    )
    try:
        response = await _run(served, body, proto, request, chat, telemetry)
    except BaseException as error:
        telemetry.end(error)
        raise
    if not isinstance(response, _HeldStream):  # a stream ends its telemetry itself
        telemetry.end()
    return response


async def _run(
    served: Served,
    body: ChatCompletionRequest | CompletionRequest,
    proto: gateway_pb2.GenerateRequest,
    request: Request,
    chat: bool,
    telemetry: RequestTelemetry,
) -> Response:
    request_id = request.state.request_id
    # Tokenizing and chat templating are CPU work: not on the loop that serves every client.
    with telemetry.phase("tokenize"):
        requests = await asyncio.to_thread(_prepare_choices, served, body, proto, request_id)
    telemetry.prepared(requests[0].params, len(requests[0].prompt_token_ids), len(requests))
    reply = Reply(
        id=f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        model=served.model_name,
        created=int(time.time()),
        chat=chat,
        return_token_ids=body.return_token_ids,
        tokenizer=served.tokenizer if _logprobs_asked(body) is not None else None,
    )
    admission = served.admission
    with telemetry.phase("admission"):
        began = time.perf_counter()
        await admission.acquire()  # raises Overloaded: 429
    telemetry.admitted(time.perf_counter() - began)
    try:
        chunks = generate_many(served.orchestrator, served.tokenizer, requests, telemetry)
        if not body.stream:
            result = await _unless_disconnected(request, reply.whole(chunks, len(requests)))
            return JSONResponse(result)
        # The first message before the headers: an unreachable worker is then a 503, not
        # an error event inside a 200 stream.
        first = await _unless_disconnected(request, _first(chunks))
        if not first:
            return Response(status_code=499)  # the client left; nobody reads this
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = reply.sse(_prepend(first, chunks), len(requests), include_usage)
        response = _HeldStream(events, admission, chunks, served.send_timeout_s, telemetry)
        admission = None  # the stream releases the slot
        return response
    finally:
        if admission is not None:
            admission.release()


async def _first(
    chunks: AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]],
) -> tuple[int, gateway_pb2.GenerateResponse]:
    """The first message of ``chunks``; closes them and raises the APIError if it fails."""
    try:
        return await anext(chunks)
    except REQUEST_ERRORS as error:
        await chunks.aclose()
        raise api_error_of(error) from None
    except BaseException:
        await chunks.aclose()
        raise


async def _prepend(
    first: tuple[int, gateway_pb2.GenerateResponse],
    chunks: AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]],
) -> AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]]:
    async with aclosing(chunks):
        yield first
        async for item in chunks:
            yield item


class _ClientStalled(Exception):
    """The client stopped reading its stream."""


class _HeldStream(StreamingResponse):
    """An SSE stream that, however it ends, stops its generations and frees its slot.

    A client that stops reading fills the socket's buffers and then every send waits; one
    that waits longer than ``send_timeout_s`` ends the stream (its connection is closed).
    """

    def __init__(
        self,
        events: AsyncIterator[str],
        admission: Admission,
        chunks: AsyncGenerator,
        send_timeout_s: float,
        telemetry: RequestTelemetry,
    ) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._admission = admission
        self._chunks = chunks
        self._send_timeout_s = send_timeout_s
        self._telemetry = telemetry

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_or_give_up(message: dict) -> None:
            try:
                async with asyncio.timeout(self._send_timeout_s):
                    await send(message)
            except TimeoutError:
                raise _ClientStalled from None

        try:
            await super().__call__(scope, receive, send_or_give_up)
        except _ClientStalled as error:
            logger.warning(
                "request %s: the client read nothing for %gs (--send-timeout); stream cancelled",
                scope.get("state", {}).get("request_id"),
                self._send_timeout_s,
            )
            self._telemetry.end(error)
        finally:
            try:
                await self._chunks.aclose()  # a stream never iterated still runs them
            finally:
                self._admission.release()
                self._telemetry.end()


def _prepare_choices(
    served: Served,
    body: ChatCompletionRequest | CompletionRequest,
    proto: gateway_pb2.GenerateRequest,
    request_id: str,
) -> list[PreparedRequest]:
    """One prepared request per choice; a seeded choice i samples with seed + i."""
    if body.n > served.limits.max_n:
        raise APIError(
            400, f"n is {body.n}; at most {served.limits.max_n} choices are allowed", param="n"
        )
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
                presence_penalty=body.presence_penalty or 0,
                frequency_penalty=body.frequency_penalty or 0,
                repetition_penalty=body.repetition_penalty or 0,  # 0: unset -> 1.0 (off)
                ignore_eos=body.ignore_eos,
            )
        )
        if body.seed is not None:
            proto.params.seed = body.seed
        top_n = _logprobs_asked(body)
        if top_n is not None:
            proto.params.logprobs = top_n
        proto.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop or [])
    except ValueError as error:  # a value outside the proto's range
        raise APIError(400, f"a parameter is out of range: {error}") from None
    try:
        first = prepare(proto, served.tokenizer, served.limits, request_id=f"{request_id}-0")
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


def _logprobs_asked(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """Top-n logprobs per token the client asked for, or None for no logprobs."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


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
