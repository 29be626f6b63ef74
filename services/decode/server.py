"""The Decode gRPC service: a prefilled request in, a stream of tokens out.

Blocks the worker's own prefix cache holds are not fetched; the rest come from the
kvstore; a block the kvstore no longer has is recomputed here. Without a first token
(colocated mode) the worker prefills the prompt itself.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from services.common.grpc_utils import start_server
from services.common.pb import decode_pb2, decode_pb2_grpc
from services.engine.async_engine import AsyncEngine
from services.engine.cli_args import add_engine_args, engine_args_from
from services.engine_proto import (
    abort_invalid,
    add_server_args,
    layout_from_proto,
    layout_to_proto,
    logprob_from_proto,
    logprob_to_proto,
    run_until_signal,
    sampling_from_proto,
)
from services.worker_runtime import (
    RequestCounter,
    add_worker_args,
    engine_publisher,
    serve_until_stopped,
)

logger = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: AsyncEngine, fetch_timeout_s: float = 30.0) -> None:
        from services.kvstore.client import KVStoreClient

        self.engine = engine
        self.layout = engine.engine.block_layout()
        self.layout_proto = layout_to_proto(self.layout)
        self.fetch_timeout_s = fetch_timeout_s
        self._kvstores: dict[str, KVStoreClient] = {}
        self._client_cls = KVStoreClient
        self.requests = RequestCounter()

    def _kvstore(self, address: str):
        if address not in self._kvstores:
            self._kvstores[address] = self._client_cls(address)
        return self._kvstores[address]

    async def _fetch(self, request: decode_pb2.DecodeRequest, context) -> dict[bytes, bytes]:
        """The prompt's blocks that this worker's own cache lacks, from the kvstore."""
        keys = list(request.block_keys)
        if not keys or not request.kvstore_address:
            return {}
        num_local = await self.engine.call(lambda e: e.local_prefix_hashes(keys))
        addresses = list(request.block_kvstore_addresses) or [request.kvstore_address] * len(keys)
        if len(addresses) != len(keys):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block_kvstore_addresses has {len(addresses)} entries for {len(keys)} blocks",
            )
        by_address: dict[str, list[bytes]] = {}
        for key, address in zip(keys[num_local:], addresses[num_local:], strict=True):
            by_address.setdefault(address, []).append(key)
        # A replica that is gone or lacks a block costs a recompute here, not the request.
        results = await asyncio.gather(
            *(
                self._kvstore(address).get_blocks(
                    self.layout_proto, wanted, timeout=self.fetch_timeout_s
                )
                for address, wanted in by_address.items()
            ),
            return_exceptions=True,
        )
        blocks: dict[bytes, bytes] = {}
        for address, result in zip(by_address, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError) and result.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ):
                logger.warning("kvstore %s: %s; recomputing its blocks", address, result.code())
                continue
            if isinstance(result, BaseException):
                raise result
            blocks.update(result[0])
        return blocks

    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        self.requests.total += 1
        try:
            params = sampling_from_proto(request.params)
        except ValueError as e:
            await abort_invalid(context, e)
        imported = None
        if request.HasField("first_token_id"):
            mismatch = self.layout.mismatch(layout_from_proto(request.layout))
            if mismatch:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"KV block layout differs from this decode worker's ({mismatch}); "
                    "prefill and decode workers must serve the same model, dtype and block size",
                )
            fetched = await self._fetch(request, context)
            first_lp = (
                logprob_from_proto(request.first_logprob)
                if request.HasField("first_logprob")
                else None
            )
            imported = (request.first_token_id, first_lp, fetched)
        prompt = list(request.prompt_token_ids)
        try:
            async for out in self.engine.generate(
                request.request_id, prompt, params, imported=imported
            ):
                if out.finish_reason == "error":
                    await context.abort(
                        grpc.StatusCode.INTERNAL, "the decode engine failed; see its log"
                    )
                yield decode_pb2.DecodeResponse(
                    token_ids=out.token_ids,
                    logprobs=[logprob_to_proto(lp) for lp in out.logprobs],
                    finish_reason=out.finish_reason or "",
                    num_cached_tokens=out.num_cached_tokens,
                    num_transferred_tokens=out.num_imported_tokens,
                )
        except ValueError as e:
            await abort_invalid(context, e)

    async def Stat(self, request, context) -> decode_pb2.DecodeStatResponse:
        def read(e):
            s = e.stats()
            return decode_pb2.DecodeStatResponse(
                num_total_blocks=s.num_total_blocks,
                num_free_blocks=s.num_free_blocks,
                num_running=s.num_running,
                num_waiting=s.num_waiting,
                prefix_cache_hits=s.prefix_cache_hits,
                prefix_cache_queries=s.prefix_cache_queries,
                kv_blocks_imported=e.num_imported_blocks,
                kv_bytes_imported=e.num_imported_bytes,
            )

        return await self.engine.call(read)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from services.engine.engine import LLMEngine
    from services.engine.prepare_model import resolve_model

    engine_args = engine_args_from(args)
    path = resolve_model(engine_args.model)
    engine = AsyncEngine(LLMEngine(engine_args, str(path)))
    servicer = DecodeServicer(engine)
    server, port = await start_server(
        f"{args.host}:{args.port}",
        [lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, s)],
        ["pdserve.v1.Decode"],
    )
    publisher = engine_publisher(args, "decode", args.host, port, engine, servicer.requests)
    try:
        await serve_until_stopped(
            "decode", f"{args.host}:{port}", server, publisher, stop, args.drain_timeout
        )
    finally:
        engine.shutdown()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve decode",
        description="Run a decode worker (it also prefills prompts sent without a first token).",
    )
    add_server_args(p, 50081)
    add_worker_args(p)
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_until_signal(lambda stop: serve(args, stop))
