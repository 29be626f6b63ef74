"""The gateway's gRPC front: Generate and GenerateStream over the orchestrator."""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from services.common.grpc_utils import start_server
from services.common.pb import gateway_pb2, gateway_pb2_grpc
from services.gateway.generation import REQUEST_ERRORS, generate
from services.gateway.orchestrator import Orchestrator
from services.gateway.requests import InvalidRequest, ModelLimits, prepare
from services.gateway.router import NoWorkerError, Router
from services.gateway.settings import GatewaySettings, SettingsError

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Gateway"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Validates and tokenizes requests, runs them, and turns token streams into text."""

    def __init__(self, orchestrator: Orchestrator, tokenizer: Any, limits: ModelLimits) -> None:
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


def model_limits(path: Path, settings: GatewaySettings) -> ModelLimits:
    """The served model's limits, with --max-model-len checked against the model's own."""
    from services.engine.config import ModelConfig

    config = ModelConfig.from_dir(path)
    limit = config.max_position_embeddings
    if config.sliding_window:
        limit = min(limit, config.sliding_window)
    if settings.max_model_len is not None and settings.max_model_len > limit:
        raise SettingsError(
            f"--max-model-len {settings.max_model_len} exceeds what the model supports ({limit})"
        )
    return ModelLimits(
        max_model_len=settings.max_model_len or limit,
        vocab_size=config.vocab_size,
        max_tokens_default=settings.max_tokens_default,
    )


async def serve(
    host: str,
    port: int,
    prefill_addrs: list[str],
    decode_addrs: list[str],
    disaggregation: bool,
    model: str | None = None,
    **options: Any,
) -> None:
    """Run the gateway until SIGTERM or SIGINT, then drain and stop.

    ``options`` are the other GatewaySettings fields (max_model_len, timeouts, ...).
    Prints ``READY gateway HOST:PORT`` on stdout once it accepts calls, then
    ``READY gateway-http HOST:HTTPPORT`` when the REST API is on (it is listening by then).
    """
    settings = GatewaySettings(
        host=host,
        port=port,
        prefill_addrs=tuple(prefill_addrs),
        decode_addrs=tuple(decode_addrs),
        disaggregation=disaggregation,
        model=model,
        **options,
    )
    from transformers import AutoTokenizer

    from services.engine.prepare_model import resolve_model

    path = resolve_model(settings.model)
    settings = replace(settings, model=str(path))
    limits = model_limits(path, settings)
    logger.info("gateway settings: %s; model limits: %s", settings, limits)
    tokenizer = AutoTokenizer.from_pretrained(path)
    router, view = await _router(settings, path)
    orchestrator = Orchestrator(
        router,
        settings.disaggregation,
        prefill_timeout_s=settings.prefill_timeout_s,
        decode_timeout_s=settings.decode_timeout_s,
        local_prefill_threshold=settings.local_prefill_threshold,
    )
    servicer = GatewayServicer(orchestrator, tokenizer, limits)
    # The HTTP socket first: a taken port then stops the start before anything else runs.
    http = None
    if settings.http_port >= 0:
        from services.gateway.admission import Admission
        from services.gateway.http import HttpServer
        from services.gateway.openai_api import Served, create_app

        served = Served(
            orchestrator,
            tokenizer,
            limits,
            settings.served_model_name or path.name,
            api_key=settings.api_key,
            max_body_bytes=settings.max_body_bytes,
            admission=Admission(
                settings.max_concurrent_requests,
                settings.max_queued_requests,
                settings.queue_timeout_s,
            ),
        )
        http = await HttpServer.start(
            create_app(served), settings.host, settings.http_port, settings.drain_timeout_s
        )
    try:
        server, bound_port = await start_server(
            f"{settings.host}:{settings.port}",
            [lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s)],
            [SERVICE_NAME],
        )
    except BaseException:
        if http is not None:
            await http.stop()
        raise
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    print(f"READY gateway {settings.host}:{bound_port}", flush=True)
    if http is not None:
        print(f"READY gateway-http {settings.host}:{http.port}", flush=True)
    try:
        await stopping.wait()
    finally:
        logger.info("draining for up to %.0fs", settings.drain_timeout_s)
        await server.health_servicer.enter_graceful_shutdown()
        stops = [server.stop(grace=settings.drain_timeout_s)]
        if http is not None:
            stops.append(http.stop())
        await asyncio.gather(*stops)
        await orchestrator.close()
        if view is not None:
            await view.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _router(settings, path):
    """The router over the registry's pools (``--redis-url``) or the fixed addresses."""
    from services.common.block_hash import model_fingerprint
    from services.gateway.router import RoutingPolicy, StaticPools

    policy = RoutingPolicy(
        settings.routing, settings.route_prefix_weight, settings.route_load_weight
    )
    if not settings.redis_url:
        pools = StaticPools(
            settings.prefill_addrs if settings.disaggregation else (), settings.decode_addrs
        )
        return Router(pools, policy), None
    from services.common.registry import RegistryView

    view = RegistryView(settings.redis_url, prefix=settings.redis_prefix)
    await view.start()
    logger.info(
        "registry at %s: %d workers (%s)",
        settings.redis_url,
        len(view.workers()),
        "reachable" if view.redis_ok else "unreachable for now",
    )
    return Router(view, policy, fingerprint=model_fingerprint(path)), view
