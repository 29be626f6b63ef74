"""The gateway's OpenAI-compatible REST front: chat and text completions, models, health.

A REST request becomes a ``GenerateRequest`` and goes through the same ``prepare`` and
``generation.generate`` as a gRPC call; this module only translates shapes and errors.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from pdserve.core.tokenizer import Tokenizer
from pdserve.gateway.admission import Admission, Overloaded
from pdserve.gateway.batch_chat import conversations, merged
from pdserve.gateway.chat_reply import ChatOptions, ChatReply
from pdserve.gateway.generation import generate_many
from pdserve.gateway.load_report import FORMAT_HEADER, named_metrics, report_header, server_load
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
    RootPathMiddleware,
)
from pdserve.gateway.openai_errors import (
    GENERATION_ERRORS,
    APIError,
    error_responses,
    validation_message,
)
from pdserve.gateway.openai_params import (
    COMPLETION_MAX_TOKENS,
    Prompt,
    chat_prompt,
    choices,
    completion_prompts,
    logprobs_asked,
    sampling,
    truncated,
)
from pdserve.gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIBase,
)
from pdserve.gateway.openai_reply import ChoiceInput, CompletionReply, ReplyOptions
from pdserve.gateway.openai_tools import ToolMode, tool_mode
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.requests import ModelLimits, PreparedRequest
from pdserve.gateway.router import NoWorkerError
from pdserve.gateway.sse_response import (
    SSEResponse,
    first_message,
    prepend,
    unless_disconnected,
)
from pdserve.gateway.telemetry import RequestTelemetry, request_attributes
from pdserve.gateway.tokenize_api import add_tokenize_routes
from pdserve.runtime import tracing
from pdserve.runtime.metrics import CONTENT_TYPE, exposition
from pdserve.settings.services import OpenAISettings

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
    serve_metrics: bool = True  # False: /metrics is served on --metrics-port, not here
    openai: OpenAISettings = field(default_factory=OpenAISettings)


def create_app(served: Served) -> FastAPI:
    """The FastAPI app of the OpenAI REST API over ``served``."""
    registry = served.metrics or GatewayMetrics(
        served.model_name, served.limits.max_model_len, served.admission, served.orchestrator
    )
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    # The last added runs first: the root path off, ids on every answer, then the key, then
    # the body's size.
    app.add_middleware(BodyLimitMiddleware, max_bytes=served.max_body_bytes)
    if served.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=served.api_key)
    app.add_middleware(RequestIdMiddleware)
    if served.openai.root_path:
        app.add_middleware(RootPathMiddleware, root_path=served.openai.root_path)

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

    # Routes answer what their OpenAPI entries say, errors included (vLLM's schemathesis test
    # of its own server checks every status and content type against the document).
    empty = {200: {"description": "OK (no body)", "content": None}}

    @app.get("/health", response_class=Response, responses=empty)
    async def health() -> Response:
        """Liveness: the gateway's process serves (whatever its pools)."""
        return Response(status_code=200)

    @app.get("/ready", responses=error_responses(503))
    async def ready() -> JSONResponse:
        """Readiness: a decode worker serving this model is routable; else 503 saying why.
        (Without a prefill worker, decode workers prefill: slower, not refused.)"""
        router = served.orchestrator.router
        try:
            decode = len(router.candidates("decode"))
        except NoWorkerError as error:
            body = APIError(503, str(error), "server_error", code="no_worker").body()
            return JSONResponse(body, status_code=503)
        counts = {"decode_workers": decode}
        if served.orchestrator.disaggregation:
            try:
                counts["prefill_workers"] = len(router.candidates("prefill"))
            except NoWorkerError:
                counts["prefill_workers"] = 0
        return JSONResponse({"status": "ready", **counts})

    @app.api_route("/ping", methods=["GET", "POST"], response_class=Response, responses=empty)
    async def ping() -> Response:
        """SageMaker's health check (as vLLM serves it): /health."""
        return Response(status_code=200)

    if served.serve_metrics:

        @app.get("/metrics", response_class=PlainTextResponse)
        async def metrics() -> Response:
            """Prometheus text: requests, admission state, routing counters, the process."""
            return Response(exposition(registry.registry), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=error_responses(401))
    async def models() -> dict[str, Any]:
        card = {
            "id": served.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "root": served.model_name,  # vLLM's: the base model (adapters name theirs)
            "parent": None,
            "max_model_len": served.limits.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's server load: generation requests in this gateway, running and queued."""
        return {"server_load": server_load(served.admission)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        """pdserve's version (vLLM serves its own here)."""
        try:
            return {"version": importlib.metadata.version("pdserve")}
        except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
            return {"version": "unknown"}

    def check_model(model: str | None) -> None:
        if model and model != served.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{served.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def check_fields(body: OpenAIBase) -> None:
        unknown = _unknown_fields(body)
        if not unknown:
            return
        if served.openai.allow_unknown_fields:
            logger.warning("ignoring unknown request fields: %s", ", ".join(unknown))
            return
        raise APIError(
            400,
            f"unknown field(s): {', '.join(unknown)}. pdserve serves the fields of OpenAI's "
            "and vLLM's APIs (docs/openai.md); --allow-unknown-fields ignores others",
            param=unknown[0],
        )

    @app.post("/v1/chat/completions", responses=GENERATION_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        check_fields(body)
        return await _complete(served, registry, body, request)

    @app.post("/v1/completions", responses=GENERATION_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        check_fields(body)
        return await _complete(served, registry, body, request)

    @app.post("/invocations", responses=GENERATION_ERRORS)
    async def invocations(request: Request) -> Response:
        """SageMaker's one endpoint (as vLLM serves it): a body with ``messages`` is a chat
        completion, one with ``prompt`` a completion."""
        body = await json_body(request)
        kind = invocation_kind(body)
        try:
            parsed = kind.model_validate(body)
        except ValidationError as error:
            raise RequestValidationError(error.errors()) from None
        check_model(parsed.model)
        check_fields(parsed)
        return await _complete(served, registry, parsed, request)

    @app.post("/v1/chat/completions/batch", responses=GENERATION_ERRORS)
    async def batch_chat_completions(request: Request) -> Response:
        """vLLM's batched chat (gateway/batch_chat.py): one choice per conversation."""
        bodies = conversations(await json_body(request))
        check_model(bodies[0].model)
        check_fields(bodies[0])
        rid = request.state.request_id
        try:  # the first error (a 400, a 429) cancels the other conversations and answers
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(_complete(served, registry, b, request, f"{rid}.{i}"))
                    for i, b in enumerate(bodies)
                ]
        except BaseExceptionGroup as errors:
            raise errors.exceptions[0] from None
        answers = [json.loads(t.result().body) for t in tasks]
        if not all(answers):
            return Response(status_code=499)  # the client left; nobody reads this
        return JSONResponse(merged(answers, f"chatcmpl-{rid}"))

    add_tokenize_routes(app, served, check_model, check_fields)
    return app


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object, or a 400."""
    try:
        body = await request.json()
    except ValueError as error:
        raise APIError(400, f"JSON decode error: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def invocation_kind(body: dict[str, Any]) -> type[ChatCompletionRequest | CompletionRequest]:
    """Which request an /invocations body is, by its fields."""
    if "messages" in body:
        return ChatCompletionRequest
    if "prompt" in body:
        return CompletionRequest
    raise APIError(
        400,
        "Cannot find suitable handler for request. Expected one of: ChatCompletionRequest "
        "(with messages), CompletionRequest (with prompt)",
    )


def _unknown_fields(body: OpenAIBase) -> list[str]:
    """Top-level fields of ``body`` (and of its options objects) that no API defines."""
    unknown = body.unknown_fields()
    for name in ("stream_options", "structured_outputs", "response_format"):
        part = getattr(body, name, None)
        if isinstance(part, OpenAIBase):
            unknown += [f"{name}.{k}" for k in part.unknown_fields()]
    return unknown


def _error_response(error: APIError) -> JSONResponse:
    """``error`` as JSON; an overloaded or unavailable gateway says when to retry."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


# -- completions -------------------------------------------------------------------------


async def _complete(
    served: Served,
    metrics: GatewayMetrics,
    body: ChatCompletionRequest | CompletionRequest,
    request: Request,
    request_id: str | None = None,
) -> Response:
    """Run ``body``; ``request_id`` names it inside pdserve (default: the HTTP request's)."""
    request_id = request_id or request.state.request_id
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
        response = await _run(served, body, request, telemetry, request_id)
    except BaseException as error:
        telemetry.end(error)
        raise
    if not isinstance(response, SSEResponse):  # a stream ends its telemetry itself
        telemetry.end()
    return response


async def _run(
    served: Served,
    body: ChatCompletionRequest | CompletionRequest,
    request: Request,
    telemetry: RequestTelemetry,
    request_id: str,
) -> Response:
    if body.request_id is None and request.state.client_request_id:
        body.request_id = request.state.client_request_id
    # Tokenizing and chat templating are CPU work: not on the loop that serves every client.
    with telemetry.phase("tokenize"):
        requests, reply = await asyncio.to_thread(_prepare, served, body, request_id)
    telemetry.prepared(requests[0].params, len(requests[0].prompt_token_ids), len(requests))
    admission = served.admission
    with telemetry.phase("admission"):
        began = time.perf_counter()
        await admission.acquire()  # raises Overloaded: 429
    telemetry.admitted(time.perf_counter() - began)
    try:
        chunks = generate_many(served.orchestrator, served.tokenizer, requests, telemetry)
        if not body.stream:
            result = await unless_disconnected(request, reply.whole(chunks))
            fmt = request.headers.get(FORMAT_HEADER)
            if not fmt:
                return JSONResponse(result)
            router = served.orchestrator.router
            headers = report_header(fmt, named_metrics(served.admission, router))
            return JSONResponse(result, headers=headers)
        # The first message before the headers: an unreachable worker is then a 503, not
        # an error event inside a 200 stream.
        first = await unless_disconnected(request, first_message(chunks))
        if not first:
            return Response(status_code=499)  # the client left; nobody reads this
        events = reply.sse(prepend(first, chunks))
        response = SSEResponse(events, admission, chunks, served.send_timeout_s, telemetry)
        admission = None  # the stream releases the slot
        return response
    finally:
        if admission is not None:
            admission.release()


def _prepare(
    served: Served, body: ChatCompletionRequest | CompletionRequest, request_id: str
) -> tuple[list[PreparedRequest], ChatReply | CompletionReply]:
    """The request's choices, and the reply that will answer it."""
    limits, tokenizer, options = served.limits, served.tokenizer, served.openai
    mode = None
    if isinstance(body, ChatCompletionRequest):
        mode = tool_mode(body, options.tool_call_parser, options.enable_auto_tool_choice)
        prompts = [truncated(chat_prompt(body, tokenizer), body, limits)]
        default = None
    else:
        prompts = completion_prompts(body, tokenizer, limits, options.max_prompts)
        prompts = [truncated(p, body, limits) for p in prompts]
        default = COMPLETION_MAX_TOKENS
    params = sampling(body, tokenizer, limits, mode)
    prepared = choices(prompts, params, body, tokenizer, limits, request_id, default)
    return prepared, _reply(served, body, prompts, prepared, mode, request_id)


def _reply(
    served: Served,
    body: ChatCompletionRequest | CompletionRequest,
    prompts: list[Prompt],
    prepared: list[PreparedRequest],
    mode: ToolMode | None,
    request_id: str,
) -> ChatReply | CompletionReply:
    chat = mode is not None
    stream = body.stream_options
    force = served.openai.enable_force_include_usage and bool(body.stream)
    include = force or bool(stream and stream.include_usage)
    as_ids = body.return_tokens_as_token_ids
    options = ReplyOptions(
        id=f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        model=served.model_name,
        created=int(time.time()),
        tokenizer=served.tokenizer,
        choices=[ChoiceInput(p.token_ids, p.text) for p in prompts for _ in range(body.n)],
        n=body.n,
        top_logprobs=logprobs_asked(body),
        prompt_logprobs=body.prompt_logprobs is not None,
        echo=body.echo and not chat,
        drop_output=not chat and body.max_tokens == 0,
        return_token_ids=bool(body.return_token_ids),
        tokens_as_ids=served.openai.return_tokens_as_token_ids if as_ids is None else as_ids,
        prompt_tokens_details=served.openai.enable_prompt_tokens_details,
        include_usage=include,
        continuous_usage=include and (force or bool(stream and stream.continuous_usage_stats)),
    )
    if not chat:
        return CompletionReply(options)
    return ChatReply(options, ChatOptions(mode, _echo_text(body)))


def _echo_text(body: ChatCompletionRequest) -> str:
    """Chat echo (vLLM's): the last message's content, when it is the assistant's."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text or "" for part in last.content)
