"""The Prefill gRPC service: prompt in; first token, block keys and cached-token count out."""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from services.common.grpc_utils import start_server
from services.common.pb import prefill_pb2, prefill_pb2_grpc
from services.engine.async_engine import AsyncEngine
from services.engine.cli_args import add_engine_args, engine_args_from
from services.engine_proto import (
    abort_invalid,
    add_server_args,
    layout_to_proto,
    logprob_to_proto,
    run_until_signal,
    sampling_from_proto,
)
from services.kvstore.placement import KVStorePlacement
from services.worker_runtime import (
    RequestCounter,
    add_worker_args,
    engine_publisher,
    registry_view,
    serve_until_stopped,
)

logger = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """Batches prompts through its engine (chunked prefill, prefix cache), then pushes blocks."""

    def __init__(
        self, engine: AsyncEngine, kvstores: KVStorePlacement, push_timeout_s: float = 30.0
    ) -> None:
        self.engine = engine
        self.kvstores = kvstores
        self.push_timeout_s = push_timeout_s
        self.layout = layout_to_proto(engine.engine.block_layout())
        self.requests = RequestCounter()

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context
    ) -> prefill_pb2.PrefillResponse:
        self.requests.total += 1
        try:
            # The first token only: decode workers generate the rest.
            params = sampling_from_proto(request.params, max_tokens=1, min_tokens=0)
            prompt = list(request.prompt_token_ids)
            full = sampling_from_proto(request.params)
        except ValueError as e:
            await abort_invalid(context, e)
        outputs = []
        try:
            async for out in self.engine.generate(
                request.request_id, prompt, params, export_blocks=True
            ):
                outputs.append(out)
        except ValueError as e:
            await abort_invalid(context, e)
        last = outputs[-1]
        if last.finish_reason == "error":
            await context.abort(grpc.StatusCode.INTERNAL, "the prefill engine failed; see its log")
        first = last.token_ids[0]
        # Does the first token already end the request (EOS, a stop id, max_tokens 1)?
        done = None
        if full.max_tokens == 1:
            done = "length"
        elif full.min_tokens == 0 and (
            first in full.stop_token_ids
            or (not full.ignore_eos and first in self.engine.engine.model_config.eos_token_ids)
        ):
            done = "stop"
        blocks = last.exported or []
        addresses: list[str] = []
        if done is None and blocks:
            try:
                addresses = self.kvstores.owners([b.key for b in blocks])
            except LookupError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            await self.kvstores.put(self.layout, blocks, addresses, self.push_timeout_s)
        resp = prefill_pb2.PrefillResponse(
            first_token_id=first,
            block_keys=[b.key for b in blocks],
            num_prompt_tokens=len(prompt),
            num_cached_tokens=last.num_cached_tokens,
            kvstore_address=addresses[0] if addresses else "",
            block_kvstore_addresses=addresses if len(set(addresses)) > 1 else [],
            layout=self.layout,
            finish_reason=done or "",
        )
        if last.logprobs:
            resp.first_logprob.CopyFrom(logprob_to_proto(last.logprobs[0]))
        return resp


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from services.engine.engine import LLMEngine
    from services.engine.prepare_model import resolve_model

    engine_args = engine_args_from(args)
    path = resolve_model(engine_args.model)
    if not args.kvstore and not args.redis_url:
        raise ValueError(
            "a prefill worker needs a kvstore: pass --kvstore HOST:PORT, or --redis-url to "
            "use the kvstore replicas registered there"
        )
    engine = AsyncEngine(LLMEngine(engine_args, str(path)))
    view = None if args.kvstore else registry_view(args)
    if view is not None:
        await view.start()
    servicer = PrefillServicer(engine, KVStorePlacement(args.kvstore, view))
    server, port = await start_server(
        f"{args.host}:{args.port}",
        [lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, s)],
        ["pdserve.v1.Prefill"],
    )
    publisher = engine_publisher(args, "prefill", args.host, port, engine, servicer.requests)
    try:
        await serve_until_stopped(
            "prefill", f"{args.host}:{port}", server, publisher, stop, args.drain_timeout
        )
    finally:
        if view is not None:
            await view.close()
        await servicer.kvstores.close()
        engine.shutdown()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve prefill", description="Run a prefill worker.")
    add_server_args(p, 50071)
    p.add_argument(
        "--kvstore",
        default=None,
        help="address of the kvstore (HOST:PORT); default: the kvstore replicas registered "
        "in --redis-url, each block to its owner by rendezvous hashing",
    )
    add_worker_args(p)
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_until_signal(lambda stop: serve(args, stop))
