"""The gateway: the gRPC front (Generate, GenerateStream) and the OpenAI REST API over the
prefill and decode pools. It loads no torch: a checkpoint's config and tokenizer are all
it reads of the model.

    pdserve gateway --port 50051 --http-port 8000 --prefill HOST:PORT --decode HOST:PORT
    pdserve gateway --redis-url URL          (the pools come from the registry)
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Sequence
from contextlib import aclosing

import grpc

from services.common.config import GatewaySettings
from services.common.grpc_utils import host_port, start_server
from services.common.model import ModelConfig, locate_model
from services.common.pb import gateway_pb2, gateway_pb2_grpc
from services.common.redaction import redact_url
from services.common.registry_view import RegistryView
from services.common.service import Serving, run_service
from services.common.tokenizer import Tokenizer
from services.common.trust import load_trust
from services.gateway.admission import Admission
from services.gateway.generation import REQUEST_ERRORS, generate
from services.gateway.http import HttpServer
from services.gateway.openai_api import Served, create_app
from services.gateway.orchestrator import Orchestrator
from services.gateway.requests import InvalidRequest, ModelLimits, prepare
from services.gateway.router import NoWorkerError, Router, RoutingPolicy, StaticPools

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Gateway"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Validates and tokenizes requests, runs them, and turns token streams into text."""

    def __init__(
        self, orchestrator: Orchestrator, tokenizer: Tokenizer, limits: ModelLimits
    ) -> None:
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.limits = limits

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GenerateResponse:
        """The whole output at once."""
        try:
            prepared = prepare(request, self.tokenizer, self.limits)
            response = gateway_pb2.GenerateResponse(request_id=prepared.request_id)
            texts = []
            async with aclosing(generate(self.orchestrator, self.tokenizer, prepared)) as chunks:
                async for chunk in chunks:
                    response.token_ids.extend(chunk.token_ids)
                    response.logprobs.extend(chunk.logprobs)
                    texts.append(chunk.text)
                    response.finish_reason = chunk.finish_reason
                    response.usage.CopyFrom(chunk.usage)
        except REQUEST_ERRORS as error:
            await context.abort(*status_of(error))
        response.text = "".join(texts)
        return response

    async def GenerateStream(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """The output as it is generated: new tokens and text per message."""
        # context.write keeps a client's cancellation inside this frame, so leaving the
        # `async with` cancels the decode call at once.
        try:
            prepared = prepare(request, self.tokenizer, self.limits)
            async with aclosing(generate(self.orchestrator, self.tokenizer, prepared)) as chunks:
                async for chunk in chunks:
                    await context.write(chunk)
        except REQUEST_ERRORS as error:
            await context.abort(*status_of(error))


def status_of(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status a client gets for one of REQUEST_ERRORS; a worker's passes through as is."""
    if isinstance(error, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, grpc.aio.AioRpcError):
        logger.warning("worker call failed: %s %s", error.code().name, error.details())
        return error.code(), error.details() or error.code().name
    if isinstance(error, NoWorkerError):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    logger.error("%s", error)
    return grpc.StatusCode.INTERNAL, f"bug in a worker: {error}"


async def start(settings: GatewaySettings, resources: contextlib.AsyncExitStack) -> Serving:
    """The model's tokenizer and limits, the router over the pools, then the REST socket (a
    taken port stops the start before anything else) and the gRPC server."""
    trust = load_trust(settings.security)
    path = locate_model(settings.model)
    config = ModelConfig.from_dir(path)
    limits = ModelLimits(
        max_model_len=config.max_model_len(settings.max_model_len),
        vocab_size=config.vocab_size,
        max_tokens_default=settings.max_tokens_default,
    )
    logger.info("model %s; limits %s", path, limits)
    tokenizer = Tokenizer.from_dir(path)
    orchestrator = Orchestrator(
        await _router(settings, config.fingerprint, resources),
        settings.disaggregation,
        prefill_timeout_s=settings.prefill_timeout,
        decode_timeout_s=settings.decode_timeout,
        local_prefill_threshold=settings.routing.local_prefill_threshold,
        trust=trust,
    )
    resources.push_async_callback(orchestrator.close)
    http = None
    if settings.http_port >= 0:
        http = await _start_http(settings, orchestrator, tokenizer, limits, path.name)
        resources.push_async_callback(http.stop)
    servicer = GatewayServicer(orchestrator, tokenizer, limits)
    server, port = await start_server(
        host_port(settings.server.host, settings.server.port),
        [lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s)],
        [SERVICE_NAME],
        # The public front: TLS as configured; its door is the API key, not the internal token.
        credentials=trust.server_credentials,
    )
    logger.info("gateway: %s", trust.describe(checks_token=False))
    resources.push_async_callback(server.stop, None)
    serving = Serving(server, port)
    if http is not None:
        serving.ready_lines.append(("gateway-http", host_port(settings.server.host, http.port)))
        serving.drains.append(lambda _grace: http.stop())
    return serving


async def _start_http(
    settings: GatewaySettings,
    orchestrator: Orchestrator,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    model_dir_name: str,
) -> HttpServer:
    """The OpenAI REST API on --http-port, with its guards."""

    served = Served(
        orchestrator,
        tokenizer,
        limits,
        settings.served_model_name or model_dir_name,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        admission=Admission(
            settings.max_concurrent_requests, settings.max_queued_requests, settings.queue_timeout
        ),
    )
    return await HttpServer.start(
        create_app(served), settings.server.host, settings.http_port, settings.server.drain_timeout
    )


async def _router(
    settings: GatewaySettings, fingerprint: bytes, resources: contextlib.AsyncExitStack
) -> Router:
    """The router over the registry's pools (``--redis-url``) or the fixed addresses."""
    routing = settings.routing
    policy = RoutingPolicy(routing.routing, routing.route_prefix_weight, routing.route_load_weight)
    redis = settings.redis
    if not redis.redis_url:
        prefill = settings.prefill_addrs if settings.disaggregation else ()
        return Router(StaticPools(prefill, settings.decode_addrs), policy)
    view = RegistryView(redis.redis_url, prefix=redis.redis_prefix)
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
