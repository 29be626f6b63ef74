"""The gateway: the gRPC front (Generate, GenerateStream) and the OpenAI REST API over the
prefill and decode pools. It loads no torch: a checkpoint's config and tokenizer are all
it reads of the model.

    pdserve gateway --port 50051 --http-port 8000 --prefill HOST:PORT --decode HOST:PORT
    pdserve gateway --redis-url URL          (the pools come from the registry)
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import sys
import time
from collections.abc import Sequence
from contextlib import aclosing
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from pdserve.controlplane.signing import Verifier
from pdserve.controlplane.view import RegistryView
from pdserve.core.model import ModelConfig, locate_model
from pdserve.core.tokenizer import ChatTemplateError, Tokenizer
from pdserve.gateway.admission import Admission, Overloaded
from pdserve.gateway.generation import REQUEST_ERRORS, generate
from pdserve.gateway.http import HttpServer, metrics_app
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openai_api import RETRY_AFTER_S, Served, create_app
from pdserve.gateway.orchestrator import Orchestrator, StreamStalled
from pdserve.gateway.public_tls import PublicTLS
from pdserve.gateway.requests import InvalidRequest, ModelLimits, PreparedRequest, prepare
from pdserve.gateway.router import NoWorkerError, Router, RoutingPolicy, StaticPools
from pdserve.gateway.telemetry import RequestTelemetry, request_attributes
from pdserve.runtime import tracing
from pdserve.runtime.rpc import start_server
from pdserve.runtime.service import Serving, run_service
from pdserve.runtime.token_ring import TokenRing
from pdserve.runtime.trust import load_trust
from pdserve.settings.process import host_port
from pdserve.settings.redaction import redact_url
from pdserve.settings.services import GatewaySettings
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Gateway"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Validates and tokenizes requests, runs them, and turns token streams into text.

    The gRPC front keeps the REST front's rules: the same API key (``authorization:
    Bearer KEY`` metadata), the same checks (``prepare``), the same admission slots
    (RESOURCE_EXHAUSTED with a retry hint when full) and the same send timeout for a
    client that stops reading its stream.
    """

    def __init__(
        self,
        orchestrator: Orchestrator,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        admission: Admission | None = None,
        api_key: str | None = None,
        send_timeout_s: float = 30.0,
        metrics: GatewayMetrics | None = None,
        model_name: str = "",
    ) -> None:
        """``metrics``: the gateway's registry (None: nothing measured)."""
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.limits = limits
        self.admission = admission or Admission(256, 512, 30.0)
        self._expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.send_timeout_s = send_timeout_s
        self.metrics = metrics
        self.model_name = model_name

    def _telemetry(self, operation: str, context: grpc.aio.ServicerContext) -> RequestTelemetry:
        metadata = context.invocation_metadata()
        return RequestTelemetry(
            self.metrics,
            tracing.from_grpc(metadata),
            attributes=request_attributes("", self.model_name, "", operation),
        )

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GenerateResponse:
        """The whole output at once."""
        telemetry = self._telemetry("Generate", context)
        try:
            return await self._generate(request, context, telemetry)
        except BaseException as error:
            telemetry.end(error)
            raise
        finally:
            telemetry.end()

    async def _generate(
        self,
        request: gateway_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        telemetry: RequestTelemetry,
    ) -> gateway_pb2.GenerateResponse:
        prepared = await self._admit(request, context, telemetry)
        try:
            response = gateway_pb2.GenerateResponse(request_id=prepared.reply_id)
            texts = []
            chunks = generate(self.orchestrator, self.tokenizer, prepared, telemetry)
            async with aclosing(chunks):
                async for chunk in chunks:
                    response.token_ids.extend(chunk.token_ids)
                    response.logprobs.extend(chunk.logprobs)
                    response.prompt_logprobs.extend(chunk.prompt_logprobs)
                    texts.append(chunk.text)
                    response.finish_reason = chunk.finish_reason
                    response.usage.CopyFrom(chunk.usage)
                    if chunk.WhichOneof("stop_reason"):
                        kind = chunk.WhichOneof("stop_reason")
                        setattr(response, kind, getattr(chunk, kind))
        except REQUEST_ERRORS as error:
            await context.abort(*status_of(error))
        finally:
            self.admission.release()
        response.text = "".join(texts)
        return response

    async def GenerateStream(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """The output as it is generated: new tokens and text per message."""
        telemetry = self._telemetry("GenerateStream", context)
        try:
            await self._generate_stream(request, context, telemetry)
        except BaseException as error:
            telemetry.end(error)
            raise
        finally:
            telemetry.end()

    async def _generate_stream(
        self,
        request: gateway_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        telemetry: RequestTelemetry,
    ) -> None:
        prepared = await self._admit(request, context, telemetry)
        # context.write keeps a client's cancellation inside this frame, so leaving the
        # `async with` cancels the decode call at once.
        stalled = False
        try:
            chunks = generate(self.orchestrator, self.tokenizer, prepared, telemetry)
            async with aclosing(chunks):
                async for chunk in chunks:
                    try:
                        async with asyncio.timeout(self.send_timeout_s):
                            await context.write(chunk)
                    except TimeoutError:
                        stalled = True
                        break
        except REQUEST_ERRORS as error:
            await context.abort(*status_of(error))
        finally:
            self.admission.release()
        if stalled:
            logger.warning(
                "request %s: the client read nothing for %gs (--send-timeout); stream cancelled",
                prepared.request_id,
                self.send_timeout_s,
            )
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the stream was not read for {self.send_timeout_s:g}s (--send-timeout)",
            )

    async def authorize(self, context: grpc.aio.ServicerContext) -> None:
        """Abort the call with UNAUTHENTICATED unless it carries the API key (when one is set)."""
        if self._expected is None:
            return
        given = dict(context.invocation_metadata()).get("authorization", "").strip()
        if not hmac.compare_digest(given.encode(), self._expected):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "Incorrect API key provided."
                if given
                else "Missing API key: send the metadata 'authorization: Bearer <key>' "
                "with the key the gateway was started with (--api-key).",
            )

    async def _admit(
        self,
        request: gateway_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        telemetry: RequestTelemetry,
    ) -> PreparedRequest:
        """The request checked and holding an admission slot (the caller releases it), or
        the call aborted: UNAUTHENTICATED, INVALID_ARGUMENT or RESOURCE_EXHAUSTED."""
        await self.authorize(context)
        try:
            # Tokenizing and chat templating are CPU work: off the loop.
            with telemetry.phase("tokenize"):
                prepared = await asyncio.to_thread(prepare, request, self.tokenizer, self.limits)
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        telemetry.span.set_attribute("gen_ai.request.id", prepared.request_id)
        if prepared.client_request_id:
            telemetry.span.set_attribute("pdserve.client_request_id", prepared.client_request_id)
        telemetry.prepared(prepared.params, len(prepared.prompt_token_ids), 1)
        try:
            with telemetry.phase("admission"):
                began = time.perf_counter()
                await self.admission.acquire()
            telemetry.admitted(time.perf_counter() - began)
        except Overloaded as error:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                str(error),
                trailing_metadata=(
                    ("retry-after", str(RETRY_AFTER_S)),
                    ("grpc-retry-pushback-ms", str(RETRY_AFTER_S * 1000)),
                ),
            )
        return prepared


def add_gateway_to_server(servicer: GatewayServicer, server: grpc.aio.Server) -> None:
    """The Gateway service, its requests parsed here: a message that is not a
    GenerateRequest gets INVALID_ARGUMENT (grpc's own parsing would answer INTERNAL)."""

    async def generate(data: bytes, context: grpc.aio.ServicerContext):
        await servicer.authorize(context)  # before anything of the message is read
        return await servicer.Generate(await _parse(data, context), context)

    async def generate_stream(data: bytes, context: grpc.aio.ServicerContext) -> None:
        await servicer.authorize(context)
        await servicer.GenerateStream(await _parse(data, context), context)

    serialize = gateway_pb2.GenerateResponse.SerializeToString
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(generate, response_serializer=serialize),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            generate_stream, response_serializer=serialize
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


async def _parse(data: bytes, context: grpc.aio.ServicerContext) -> gateway_pb2.GenerateRequest:
    try:
        return gateway_pb2.GenerateRequest.FromString(data)
    except DecodeError as error:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"the message is not a GenerateRequest: {error}"
        )


def status_of(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status a client gets for one of REQUEST_ERRORS; a worker's passes through as is."""
    if isinstance(error, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, grpc.aio.AioRpcError):
        logger.warning("worker call failed: %s %s", error.code().name, error.details())
        return error.code(), error.details() or error.code().name
    if isinstance(error, NoWorkerError | StreamStalled):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    logger.error("%s", error)
    return grpc.StatusCode.INTERNAL, f"bug in a worker: {error}"


async def start(settings: GatewaySettings, resources: contextlib.AsyncExitStack) -> Serving:
    """The model's tokenizer and limits, the router over the pools, then the REST socket (a
    taken port stops the start before anything else) and the gRPC server."""
    trust = load_trust(settings.security)
    public_tls = None
    if settings.ssl_certfile:
        public_tls = PublicTLS(settings.ssl_certfile, settings.ssl_keyfile)
    elif settings.security.tls_cert:
        logger.warning(
            "--tls-cert is the gateway's identity towards the workers, never shown to its "
            "clients: its REST and gRPC fronts are plaintext; pass --ssl-certfile and "
            "--ssl-keyfile for TLS to clients"
        )
    path = locate_model(settings.model)
    tokenizer = load_tokenizer(path, settings.openai.chat_template)
    config = ModelConfig.from_dir(path)
    limits = ModelLimits(
        max_model_len=config.max_model_len(settings.max_model_len),
        vocab_size=config.vocab_size,
        max_tokens_default=settings.max_tokens_default,
        max_n=settings.max_n,
        max_stop=settings.max_stop,
        max_stop_chars=settings.max_stop_chars,
        max_logprobs=settings.max_logprobs,
    )
    logger.info("model %s; limits %s", path, limits)
    orchestrator = Orchestrator(
        await _router(settings, config.fingerprint, trust.tokens, resources),
        settings.disaggregation,
        prefill_timeout_s=settings.prefill_timeout,
        decode_timeout_s=settings.decode_timeout,
        local_prefill_threshold=settings.routing.local_prefill_threshold,
        trust=trust,
        migration_limit=settings.migration_limit,
        stream_idle_timeout_s=settings.stream_idle_timeout,
        migration_wait_s=settings.migration_wait,
    )
    resources.push_async_callback(orchestrator.close)
    # One gateway, one capacity: REST and gRPC requests take slots from the same bounds.
    admission = Admission(
        settings.max_concurrent_requests, settings.max_queued_requests, settings.queue_timeout
    )
    model_name = settings.served_model_name or path.name
    metrics = GatewayMetrics(model_name, limits.max_model_len, admission, orchestrator)
    started: list[Serving] = []  # the service, once built: its draining flag
    metrics_server = None
    if settings.metrics_port >= 0:  # OSError when it cannot bind
        # In this event loop: the gateway's collectors read the registry view, which is its.
        app = metrics_app(metrics.registry, lambda: bool(started) and not started[0].draining)
        metrics_server = await HttpServer.start(
            app, settings.server.host, settings.metrics_port, settings.server.drain_timeout
        )
        resources.push_async_callback(metrics_server.stop)
    http = None
    if settings.http_port >= 0:
        http = await _start_http(
            settings, orchestrator, tokenizer, limits, model_name, metrics, public_tls
        )
        resources.push_async_callback(http.stop)
    servicer = GatewayServicer(
        orchestrator,
        tokenizer,
        limits,
        admission=admission,
        api_key=settings.api_key,
        send_timeout_s=settings.send_timeout,
        metrics=metrics,
        model_name=model_name,
    )
    server, port = await start_server(
        host_port(settings.server.host, settings.server.port),
        [lambda s: add_gateway_to_server(servicer, s)],
        [SERVICE_NAME],
        max_receive_bytes=settings.max_body_bytes,
        # The public front: TLS with the public pair (never the internal certificate); its
        # door is the API key, not the internal token.
        credentials=public_tls.grpc_credentials() if public_tls else None,
    )
    logger.info(
        "gateway: public fronts %s; to the workers: %s",
        "TLS (--ssl-certfile)" if public_tls else "plaintext",
        trust.describe(server=False),
    )
    resources.push_async_callback(server.stop, None)
    serving = Serving(server, port)
    started.append(serving)
    if metrics_server is not None:
        address = host_port(settings.server.host, metrics_server.port)
        serving.ready_lines.append(("gateway-metrics", address))
    if http is not None:
        serving.ready_lines.append(("gateway-http", host_port(settings.server.host, http.port)))
        serving.drains.append(lambda _grace: http.stop())
    return serving


async def _start_http(
    settings: GatewaySettings,
    orchestrator: Orchestrator,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    model_name: str,
    metrics: GatewayMetrics,
    public_tls: PublicTLS | None,
) -> HttpServer:
    """The OpenAI REST API on --http-port, with its guards, and the gateway's /metrics."""

    served = Served(
        orchestrator,
        tokenizer,
        limits,
        model_name,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        admission=metrics.admission,
        send_timeout_s=settings.send_timeout,
        metrics=metrics,
        openai=settings.openai,
        serve_metrics=settings.metrics_port < 0,
    )
    return await HttpServer.start(
        create_app(served),
        settings.server.host,
        settings.http_port,
        settings.server.drain_timeout,
        public_tls,
    )


def load_tokenizer(path: Path, chat_template: str | None) -> Tokenizer:
    """The model's tokenizer, with --chat-template's template (a file's text, or the value
    itself when it is a Jinja template) instead of its own; ValueError (a bad start) when
    it is neither, or does not compile."""
    tokenizer = Tokenizer.from_dir(path)
    if chat_template is None:
        return tokenizer
    file = Path(chat_template).expanduser()
    if file.is_file():
        text = file.read_text(encoding="utf-8")
    elif "{" in chat_template:
        text = chat_template
    else:
        raise ValueError(f"--chat-template: {chat_template} is no file (nor a Jinja template)")
    try:
        return tokenizer.with_chat_template(text)
    except ChatTemplateError as error:
        raise ValueError(f"--chat-template: {error}") from None


async def _router(
    settings: GatewaySettings,
    fingerprint: bytes,
    tokens: TokenRing | None,
    resources: contextlib.AsyncExitStack,
) -> Router:
    """The router over the registry's pools (``--redis-url``: the entries the internal
    token signed, when there is one) or the fixed addresses."""
    routing = settings.routing
    policy = RoutingPolicy(routing.routing, routing.route_prefix_weight, routing.route_load_weight)
    redis = settings.redis
    if not redis.redis_url:
        prefill = settings.prefill_addrs if settings.disaggregation else ()
        return Router(StaticPools(prefill, settings.decode_addrs), policy)
    view = RegistryView(
        redis.redis_url, prefix=redis.redis_prefix, verifier=Verifier.following(tokens)
    )
    await view.start()
    resources.push_async_callback(view.close)
    logger.info(
        "registry at %s: %d workers (%s)",
        redact_url(redis.redis_url),
        len(view.workers()),
        "reachable" if view.redis_ok else "unreachable for now",
    )
    return Router(view, policy, fingerprint=fingerprint)


def main(argv: Sequence[str] | None = None) -> int:
    """`pdserve gateway`."""
    return run_service(
        "gateway",
        GatewaySettings,
        argv,
        "The pdserve gateway: gRPC Generate/GenerateStream and the OpenAI REST API over "
        "prefill and decode workers.",
        start,
    )


if __name__ == "__main__":
    sys.exit(main())
