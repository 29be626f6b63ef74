"""The prefill worker: prompt in; first token, block keys and cached-token count out.

pdserve prefill --port 50071 --kvstore HOST:PORT   (or --redis-url URL)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
import uuid
from collections.abc import Sequence

import grpc

from pdserve.controlplane.registry import new_worker_id
from pdserve.controlplane.signing import Verifier
from pdserve.controlplane.view import RegistryView
from pdserve.core.finish_reason import FinishReason
from pdserve.engine.async_engine import AsyncEngine
from pdserve.kv.blocks import ExportedBlock, tail_key
from pdserve.kv.client import KVStorePlacement, get_grouped
from pdserve.kv.convert import layout_to_proto
from pdserve.runtime import tracing
from pdserve.runtime.service import Serving, run_service
from pdserve.runtime.trust import load_trust
from pdserve.settings.services import PrefillSettings
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from pdserve.wire.convert import finish_reason_to_proto, logprob_to_proto, sampling_from_proto
from pdserve.worker.grammars import GrammarPreparer
from pdserve.worker.nixl import NixlEndpoint, Staged, open_endpoint
from pdserve.worker.runtime import (
    error_status,
    prepare_grammar,
    serve_engine,
    start_engine,
)
from pdserve.worker.telemetry import RequestRecord, WorkerMetrics, request_attributes

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Prefill"


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """Batches prompts through its engine (chunked prefill, prefix cache), then pushes blocks."""

    def __init__(
        self,
        engine: AsyncEngine,
        kvstores: KVStorePlacement,
        push_timeout_s: float = 10.0,
        metrics: WorkerMetrics | None = None,
        worker_id: str = "",
        grammars: GrammarPreparer | None = None,
        nixl: NixlEndpoint | None = None,
        prefix_fetch_timeout_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.grammars = grammars
        self.kvstores = kvstores
        self.push_timeout_s = push_timeout_s
        self.layout = layout_to_proto(engine.info.layout)
        self.metrics = metrics or WorkerMetrics(engine, "prefill")
        self.worker_id = worker_id
        self.nixl = nixl
        self.prefix_fetch_timeout_s = prefix_fetch_timeout_s  # 0: no shared prefix tier
        self._pushes: set[asyncio.Task] = set()  # kvstore pushes after a NIXL answer

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        parent = tracing.from_grpc(context.invocation_metadata())
        with tracing.start_span("prefill.request", parent, kind=tracing.SERVER) as span:
            if span.is_recording():
                span.set_attributes(request_attributes(request, self.worker_id))
            record = RequestRecord(self.metrics, span, len(request.prompt_token_ids), True)
            try:
                return await self._prefill(request, context, record)
            finally:
                record.abandoned()

    async def _prefill(
        self,
        request: prefill_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext,
        record: RequestRecord,
    ) -> prefill_pb2.PrefillResponse:
        prompt = list(request.prompt_token_ids)
        try:
            params = sampling_from_proto(request.params)
            await prepare_grammar(self.grammars, params, context)
            if self.prefix_fetch_timeout_s:
                await self._fetch_prefix(request.request_id, prompt, record.span)
            deltas = []
            async for delta in self.engine.generate(
                request.request_id, prompt, params, prefill_only=True
            ):
                record.delta(delta)
                deltas.append(delta)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        last = deltas[-1]
        record.finish(last)
        if last.finish_reason is FinishReason.ERROR:
            await context.abort(*error_status(request.request_id, last.error))
        blocks = last.exported or []  # only a PREFILLED request has any
        staged = None
        if blocks and self.nixl is not None and request.decode_reads_nixl:
            staged = await self._stage(request.request_id, blocks)
        if staged is not None:
            addresses = self._push_later(request.request_id, blocks, record.span)
        elif blocks:
            addresses = await self._push(request.request_id, blocks, record.span)
        else:
            addresses = []
        response = prefill_pb2.PrefillResponse(
            first_token_id=last.token_ids[0],
            block_keys=[b.key for b in blocks],
            num_prompt_tokens=len(prompt),
            num_cached_tokens=last.num_cached_tokens,
            kvstore_address=addresses[0] if addresses else "",
            block_kvstore_addresses=addresses if len(set(addresses)) > 1 else [],
            layout=self.layout,
            finish_reason=finish_reason_to_proto(last.finish_reason),
        )
        if staged is not None:
            response.nixl.CopyFrom(
                common_pb2.NixlSource(
                    worker_id=self.worker_id,
                    agent_name=self.nixl.name,
                    addresses=staged.addresses,
                    checksums=staged.checksums,
                    block_bytes=self.nixl.block_bytes,
                    lease=staged.lease,
                )
            )
        if last.logprobs:
            response.first_logprob.CopyFrom(logprob_to_proto(last.logprobs[0]))
        if deltas[0].prompt_logprobs is not None:
            response.prompt_logprobs.extend(map(logprob_to_proto, deltas[0].prompt_logprobs))
        return response

    async def _fetch_prefix(self, request_id: str, prompt: list[int], parent: object) -> int:
        """The shared prefix tier: the prompt's full blocks after those this worker's
        prefix cache holds, looked up in their kvstores (any prefill worker pushed them,
        or the kvstore's disk kept them), checked, and the run that continues the cached
        prefix imported into the prefix cache; how many blocks. Any failure: computed
        here as before."""
        keys = await self.engine.call(lambda e: e.prefix_to_fetch(prompt))
        if not keys:
            return 0
        try:
            owners = self.kvstores.owners(keys)
        except LookupError:
            return 0
        began = time.perf_counter()
        with tracing.start_span("prefill.kv_prefix_fetch", parent, kind=tracing.CLIENT) as span:
            results = await get_grouped(
                self.kvstores.client, self.layout, keys, owners, self.prefix_fetch_timeout_s
            )
            fetched: dict[bytes, bytes] = {}
            for address, (_, result) in results.items():
                if isinstance(result, grpc.aio.AioRpcError):
                    logger.warning(
                        "request %s: prefix lookup in kvstore %s failed (%s); computing it",
                        request_id,
                        address,
                        result.code().name,
                    )
                    continue
                fetched.update(result.found)
            if not fetched:
                return 0
            imported = await self.engine.call(lambda e: e.import_prefix(prompt, fetched))
            if span.is_recording():
                span.set_attributes({"pdserve.prefix_blocks": imported})
        if imported:
            num_bytes = imported * len(next(iter(fetched.values())))
            elapsed = time.perf_counter() - began
            self.metrics.transfer("prefix_fetch", imported, num_bytes, elapsed)
        return imported

    async def _stage(self, request_id: str, blocks: list[ExportedBlock]) -> Staged | None:
        """Hold ``blocks`` in NIXL-registered memory for the decode worker's read; None
        (they go through the kvstore) when the buffer has too few free slots."""
        began = time.perf_counter()
        staged = await self.nixl.stage(f"{request_id}/{uuid.uuid4().hex[:8]}", blocks)
        if staged is None:
            self.metrics.transfer_failed("nixl_stage")
            logger.warning(
                "request %s: %d blocks do not fit in --nixl-buffer-bytes now; pushing them to "
                "the kvstore",
                request_id,
                len(blocks),
            )
            return None
        num_bytes = len(blocks) * self.nixl.block_bytes
        self.metrics.transfer("nixl_stage", len(blocks), num_bytes, time.perf_counter() - began)
        return staged

    def _push_later(
        self, request_id: str, blocks: list[ExportedBlock], parent: object
    ) -> list[str]:
        """Push the full blocks to their kvstores after the answer (the fallback of a NIXL
        read, and the prefix tier); each block's address ("" for the tail: it is single-use
        and travels over NIXL only)."""
        full = [b for b in blocks if b.key != tail_key(request_id)]
        if not full:
            return [""] * len(blocks)
        try:
            keys = [b.key for b in full]
            owners = dict(zip(keys, self.kvstores.owners(keys), strict=True))
        except LookupError:
            return [""] * len(blocks)
        task = asyncio.create_task(self._push(request_id, full, parent))
        self._pushes.add(task)
        task.add_done_callback(self._pushes.discard)
        return [owners.get(b.key, "") for b in blocks]

    async def close(self) -> None:
        """Stop the pushes still running, then the kvstore channels."""
        for task in list(self._pushes):
            task.cancel()
        await asyncio.gather(*self._pushes, return_exceptions=True)
        await self.kvstores.close()

    async def _push(
        self, request_id: str, blocks: list[ExportedBlock], parent: object
    ) -> list[str]:
        """Push ``blocks`` to their kvstores; each block's address, "" where its push failed
        (the decode worker recomputes those blocks: a kvstore fault costs no request)."""
        try:
            addresses = self.kvstores.owners([b.key for b in blocks])
        except LookupError as e:
            logger.warning("request %s: blocks not pushed: %s", request_id, e)
            self.metrics.transfer_failed("push")
            return [""] * len(blocks)
        with tracing.start_span("prefill.kv_push", parent, kind=tracing.CLIENT) as span:
            began = time.perf_counter()
            failed = await self.kvstores.put(
                self.layout,
                blocks,
                addresses,
                self.push_timeout_s,
                metadata=tracing.grpc_metadata(span),
            )
            pushed = [b for b, a in zip(blocks, addresses, strict=True) if a not in failed]
            num_bytes = sum(len(b.data) for b in pushed)
            self.metrics.transfer("push", len(pushed), num_bytes, time.perf_counter() - began)
            if span.is_recording():
                span.set_attributes(
                    {
                        "pdserve.transferred_blocks": len(pushed),
                        "pdserve.transferred_bytes": num_bytes,
                        "pdserve.failed_blocks": len(blocks) - len(pushed),
                        "pdserve.kvstores": sorted(set(addresses)),
                    }
                )
                parent.set_attributes(
                    {
                        "pdserve.transferred_blocks": len(pushed),
                        "pdserve.transferred_bytes": num_bytes,
                    }
                )
        for address, error in failed.items():
            self.metrics.transfer_failed("push")
            logger.warning(
                "request %s: push to kvstore %s failed (%s: %s); the decode worker will "
                "recompute its blocks",
                request_id,
                address,
                error.code().name,
                error.details(),
            )
        return ["" if a in failed else a for a in addresses]


async def start(settings: PrefillSettings, resources: contextlib.AsyncExitStack) -> Serving:
    """Load the engine, find the kvstore(s), serve."""
    trust = load_trust(settings.security)  # a bad file stops the start before the model loads
    engine, grammars = start_engine(settings, resources)
    view = None
    if not settings.kvstore:
        redis = settings.registry.redis
        view = RegistryView(
            redis.redis_url, prefix=redis.redis_prefix, verifier=Verifier.following(trust.tokens)
        )
        await view.start()
        resources.push_async_callback(view.close)
    placement = KVStorePlacement(settings.kvstore, view, trust)
    metrics, worker_id = WorkerMetrics(engine, "prefill"), new_worker_id("prefill")
    has_registry = bool(settings.registry.redis.redis_url)
    nixl = open_endpoint(
        "prefill", settings.transport, engine.info.layout, worker_id, has_registry, resources
    )
    servicer = PrefillServicer(
        engine,
        placement,
        settings.kv_push_timeout,
        metrics,
        worker_id,
        grammars,
        nixl,
        settings.kv_prefix_fetch_timeout,
    )
    resources.push_async_callback(servicer.close)
    if nixl is not None:
        poller = asyncio.create_task(_release_read_blocks(nixl))
        resources.callback(poller.cancel)
    return await serve_engine(
        settings,
        resources,
        "prefill",
        engine,
        lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, s),
        SERVICE_NAME,
        trust,
        metrics,
        worker_id,
        nixl.entry_fields() if nixl is not None else None,
    )


async def _release_read_blocks(nixl: NixlEndpoint, period_s: float = 0.02) -> None:
    """Free staged blocks as their decode workers' reads complete (and those expired)."""
    while True:
        try:
            await nixl.poll()
        except Exception:  # noqa: BLE001 (a poll that fails is tried again)
            logger.exception("NIXL notifications")
        await asyncio.sleep(period_s)


def main(argv: Sequence[str] | None = None) -> int:
    """`pdserve prefill`."""
    return run_service(
        "prefill",
        PrefillSettings,
        argv,
        "Run a prefill worker: it prefills prompts in batches (chunked prefill, prefix "
        "cache), samples each one's first token and pushes its KV blocks to the kvstore.",
        start,
    )


if __name__ == "__main__":
    sys.exit(main())
