"""The decode worker: a prefilled request in, a stream of tokens out.

Blocks the worker's own prefix cache holds are not fetched; the rest come from the
kvstore; a block the kvstore no longer has, one whose header, length or checksum is
wrong, and every block of a kvstore whose fetch fails (an error, past
``--kv-fetch-timeout``, down) is recomputed here: a kvstore fault costs a recompute, never
the request. The request's tail block is fetched single-use (the kvstore drops it once
read). A caller that goes away cancels the call, and the request's blocks are freed at
once: a dead process's sockets are closed by its kernel, and a peer that vanished without
closing (its host gone, the process frozen) misses the keepalive ping
(``grpc_utils._KEEPALIVE``: every 20 s, 10 s to answer), so within 30 s. Without a first token (colocated mode) the worker prefills the
prompt itself. The worker dials only kvstores it knows, registered in Redis or given by
``--kvstore``: a request naming another is refused before any connection (the worker would
send it the internal token).

    pdserve decode --port 50081 [--redis-url URL] [--kvstore HOST:PORT]
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from pdserve.controlplane.registry import new_worker_id
from pdserve.controlplane.signing import Verifier
from pdserve.controlplane.view import RegistryView
from pdserve.core.finish_reason import FinishReason
from pdserve.core.sampling import SamplingParams
from pdserve.core.spec_stats import SpecDecodeStats
from pdserve.decode.kvstores import KnownKVStores
from pdserve.engine.async_engine import AsyncEngine, EngineDead, Handover
from pdserve.kv.blocks import FetchedBlocks, LayoutMismatch, show_key, tail_key
from pdserve.kv.client import KVStoreClient, get_grouped
from pdserve.kv.convert import layout_from_proto, layout_to_proto
from pdserve.runtime import tracing
from pdserve.runtime.service import Serving, run_service
from pdserve.runtime.trust import Trust, load_trust
from pdserve.settings.services import DecodeSettings
from pdserve.v1 import decode_pb2, decode_pb2_grpc
from pdserve.wire.convert import (
    finish_reason_to_proto,
    logprob_from_proto,
    logprob_to_proto,
    sampling_from_proto,
)
from pdserve.worker.grammars import GrammarPreparer
from pdserve.worker.nixl import NixlEndpoint, NixlReadError, open_endpoint
from pdserve.worker.runtime import (
    error_status,
    prepare_grammar,
    serve_engine,
    start_engine,
)
from pdserve.worker.telemetry import RequestRecord, WorkerMetrics, request_attributes

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Decode"
# While a request is prepared (its grammar compiled), an empty message every this many
# seconds: well inside any gateway's --stream-idle-timeout.
HEARTBEAT_S = 0.5


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Generates the tokens after a prefill worker's first one (or all, colocated)."""

    def __init__(
        self,
        engine: AsyncEngine,
        kvstores: KnownKVStores,
        trust: Trust | None = None,
        fetch_timeout_s: float = 10.0,
        metrics: WorkerMetrics | None = None,
        worker_id: str = "",
        grammars: GrammarPreparer | None = None,
        nixl: NixlEndpoint | None = None,
        view: RegistryView | None = None,
    ) -> None:
        self.engine = engine
        self.nixl = nixl
        self.view = view  # where a NIXL read finds its prefill worker's agent
        self.grammars = grammars
        self.metrics = metrics or WorkerMetrics(engine, "decode")
        self.worker_id = worker_id
        self.layout = engine.info.layout
        self.layout_proto = layout_to_proto(self.layout)
        self.known_kvstores = kvstores
        self.trust = trust
        self.fetch_timeout_s = fetch_timeout_s
        self._kvstores: dict[str, KVStoreClient] = {}
        self.num_fetch_failures = 0  # fetches from one kvstore that failed: recomputed

    def _kvstore(self, address: str) -> KVStoreClient:
        if address not in self._kvstores:
            self._kvstores[address] = KVStoreClient(address, self.trust)
        return self._kvstores[address]

    async def close(self) -> None:
        clients, self._kvstores = list(self._kvstores.values()), {}
        await asyncio.gather(*(c.close() for c in clients))

    async def _fetch(
        self, request_id: str, keys: list[bytes], addresses: list[str], metadata=None
    ) -> FetchedBlocks:
        """The blocks under ``keys`` from their kvstores (each replica in parallel; an
        address "" was never pushed), each checked against this worker's layout and its
        checksum. A replica whose fetch fails, whatever the gRPC error, gives nothing: its
        blocks are recomputed."""
        results = await get_grouped(
            self._kvstore,
            self.layout_proto,
            keys,
            addresses,
            self.fetch_timeout_s,
            single_use=[tail_key(request_id)],
            metadata=metadata,
        )
        fetched = FetchedBlocks()
        for address, (wanted, result) in results.items():
            if isinstance(result, grpc.aio.AioRpcError):
                self.num_fetch_failures += 1
                self.metrics.transfer_failed("fetch")
                logger.warning(
                    "request %s: fetch from kvstore %s failed (%s: %s); recomputing its %d blocks",
                    request_id,
                    address,
                    result.code().name,
                    result.details(),
                    len(wanted),
                )
                continue
            if result.rejected:
                key, why = next(iter(result.rejected.items()))
                logger.warning(
                    "kvstore %s: %d blocks refused (the first, %s: %s); recomputing them",
                    address,
                    len(result.rejected),
                    show_key(key),
                    why,
                )
            fetched.merge(result)
        return fetched

    async def _read_nixl(
        self, request: decode_pb2.DecodeRequest, keys: list[bytes], num_local: int
    ) -> FetchedBlocks:
        """The blocks after the first ``num_local`` read from the prefill worker's memory
        over NIXL, each checked against its checksum; nothing (the kvstore, else a
        recompute, brings them) when the read cannot be made or fails."""
        source = request.nixl
        why = None
        peer = None
        if self.nixl is None:
            why = "this worker reads KV over gRPC (--kv-transport)"
        elif len(source.addresses) != len(keys) or len(source.checksums) != len(keys):
            why = f"the hand-over names {len(source.addresses)} addresses for {len(keys)} blocks"
        elif source.block_bytes != self.nixl.block_bytes:
            why = (
                f"its blocks have {source.block_bytes} bytes, this worker's {self.nixl.block_bytes}"
            )
        else:
            peer = next(
                (w for w in self.view.workers("prefill") if w.worker_id == source.worker_id), None
            )
            if peer is None or not peer.nixl_metadata:
                why = f"prefill worker {source.worker_id} is not in the registry with a NIXL agent"
            elif peer.nixl_agent != source.agent_name:
                why = f"prefill worker {source.worker_id}'s NIXL agent is not {source.agent_name}"
        if why is not None:
            logger.warning("request %s: no NIXL read: %s", request.request_id, why)
            return FetchedBlocks()
        bs, n = self.layout.block_size, len(request.prompt_token_ids)
        wanted = [
            (keys[i], source.addresses[i], source.checksums[i], bs if (i + 1) * bs <= n else n % bs)
            for i in range(num_local, len(keys))
        ]
        began = time.perf_counter()
        try:
            fetched = await self.nixl.read(
                peer.worker_id,
                peer.nixl_agent,
                peer.nixl_metadata,
                source.lease,
                wanted,
                self.fetch_timeout_s,
            )
        except NixlReadError as e:
            self.metrics.transfer_failed("nixl_read")
            logger.warning(
                "request %s: NIXL read of %d blocks from %s failed (%s); the kvstore or a "
                "recompute brings them",
                request.request_id,
                len(wanted),
                source.worker_id,
                e,
            )
            return FetchedBlocks()
        if fetched.rejected:
            logger.warning(
                "request %s: %d blocks read over NIXL failed their checksum; the kvstore or "
                "a recompute brings them",
                request.request_id,
                len(fetched.rejected),
            )
        num_bytes = len(fetched.found) * self.nixl.block_bytes
        elapsed = time.perf_counter() - began
        self.metrics.transfer("nixl_read", len(fetched.found), num_bytes, elapsed)
        return fetched

    async def _handover(
        self,
        request: decode_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext,
        record: RequestRecord,
    ) -> Handover | None:
        """What the prefill worker handed over (None in colocated mode); aborts the call on a
        layout that is not this worker's."""
        if not request.HasField("first_token_id"):
            if request.resume_token_ids:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "resume_token_ids needs first_token_id"
                )
            return None
        theirs = layout_from_proto(request.layout)
        # A migrated colocated stream has a first token but no blocks and no layout.
        given = request.HasField("layout") or bool(request.block_keys)
        if given and theirs != self.layout:
            error = LayoutMismatch(
                self.layout,
                theirs,
                "KV block layout differs from this decode worker's",
                "ours",
                "theirs",
                hint="prefill and decode workers must serve the same model, dtype and block size",
            )
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        keys = list(request.block_keys)
        addresses = list(request.block_kvstore_addresses) or [request.kvstore_address] * len(keys)
        if len(addresses) != len(keys):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block_kvstore_addresses has {len(addresses)} entries for {len(keys)} blocks",
            )
        unknown = await self.known_kvstores.unknown({a for a in addresses if a})
        if unknown:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"kvstore {', '.join(unknown)} is not one this decode worker fetches from "
                f"(it knows {self.known_kvstores.describe()})",
            )

        async def fetch(num_local: int) -> FetchedBlocks:
            nixl = request.HasField("nixl")
            if not request.kvstore_address and not request.block_kvstore_addresses and not nixl:
                record.fetched_at = time.time()
                return FetchedBlocks()
            with tracing.start_span("decode.kv_fetch", record.span, kind=tracing.CLIENT) as span:
                began = time.perf_counter()
                fetched = FetchedBlocks()
                if nixl:  # counted as nixl_read
                    fetched = await self._read_nixl(request, keys, num_local)
                num_read = len(fetched.found)
                rest = [
                    (k, a)
                    for k, a in zip(keys[num_local:], addresses[num_local:], strict=True)
                    if a and k not in fetched.found
                ]
                if rest:
                    fetched.merge(
                        await self._fetch(
                            request.request_id,
                            [k for k, _ in rest],
                            [a for _, a in rest],
                            tracing.grpc_metadata(span),
                        )
                    )
                num_bytes = sum(len(data) for data in fetched.found.values())
                blocks = len(fetched.found)
                if rest or not nixl:
                    self.metrics.transfer(
                        "fetch",
                        blocks - num_read,
                        num_bytes - num_read * self.layout.block_bytes,
                        time.perf_counter() - began,
                    )
                if span.is_recording():
                    transferred = {
                        "pdserve.transferred_blocks": blocks,
                        "pdserve.transferred_bytes": num_bytes,
                    }
                    span.set_attributes(
                        {
                            **transferred,
                            "pdserve.local_blocks": num_local,
                            "pdserve.missing_blocks": len(fetched.missing),
                            "pdserve.rejected_blocks": len(fetched.rejected),
                        }
                    )
                    record.span.set_attributes({**transferred, "pdserve.local_blocks": num_local})
            record.fetched_at = time.time()
            return fetched

        first_logprob = (
            logprob_from_proto(request.first_logprob) if request.HasField("first_logprob") else None
        )
        resumed = tuple(request.resume_token_ids)
        return Handover(request.first_token_id, first_logprob, fetch, resumed)

    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        parent = tracing.from_grpc(context.invocation_metadata())
        with tracing.start_span("decode.request", parent, kind=tracing.SERVER) as span:
            if span.is_recording():
                span.set_attributes(request_attributes(request, self.worker_id))
                span.set_attribute("pdserve.resumed_tokens", len(request.resume_token_ids))
            first_here = not request.HasField("first_token_id")
            record = RequestRecord(self.metrics, span, len(request.prompt_token_ids), first_here)
            try:
                async for response in self._decode(request, context, record):
                    yield response
            finally:
                record.abandoned()

    async def _decode(
        self,
        request: decode_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext,
        record: RequestRecord,
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        try:
            params = sampling_from_proto(request.params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        async for heartbeat in self._prepare(params, context):
            yield heartbeat
        handover = await self._handover(request, context, record)
        prompt = list(request.prompt_token_ids)
        try:
            async for delta in self.engine.generate(
                request.request_id, prompt, params, handover=handover
            ):
                record.delta(delta)
                if delta.finish_reason is not None:
                    record.finish(delta)
                if delta.finish_reason is FinishReason.ERROR:
                    await context.abort(*error_status(request.request_id, delta.error))
                yield decode_pb2.DecodeResponse(
                    token_ids=delta.token_ids,
                    logprobs=[logprob_to_proto(lp) for lp in delta.logprobs],
                    finish_reason=finish_reason_to_proto(delta.finish_reason),
                    num_cached_tokens=delta.num_cached_tokens,
                    num_transferred_tokens=delta.num_imported_tokens,
                    spec=spec_to_proto(delta.spec),
                    prompt_logprobs=map(logprob_to_proto, delta.prompt_logprobs or ()),
                )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _prepare(
        self, params: SamplingParams, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """Compile the request's grammar, sending an empty message every HEARTBEAT_S while
        it takes (loading xgrammar, a slow schema): the gateway then knows the worker lives,
        within its --stream-idle-timeout."""
        task = asyncio.ensure_future(prepare_grammar(self.grammars, params, context))
        try:
            while not (await asyncio.wait({task}, timeout=HEARTBEAT_S))[0]:
                yield decode_pb2.DecodeResponse()
            task.result()  # the call aborted with the grammar's error, if any
        finally:
            task.cancel()

    async def Stat(
        self, request: decode_pb2.DecodeStatRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.DecodeStatResponse:
        try:
            s = await self.engine.call(lambda e: e.stats())
        except EngineDead as e:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the worker's engine failed ({e}); it is leaving"
            )
        return decode_pb2.DecodeStatResponse(
            num_total_blocks=s.num_total_blocks,
            num_free_blocks=s.num_free_blocks,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            prefix_cache_hits=s.prefix_cache_hits,
            prefix_cache_queries=s.prefix_cache_queries,
            kv_blocks_imported=s.num_imported_blocks,
            kv_bytes_imported=s.num_imported_bytes,
            kv_blocks_rejected=s.num_rejected_blocks,
            kv_fetch_failures=self.num_fetch_failures,
        )


def spec_to_proto(spec: SpecDecodeStats | None) -> decode_pb2.SpecDecodeCounts | None:
    if spec is None:
        return None
    return decode_pb2.SpecDecodeCounts(
        num_drafts=spec.num_drafts,
        num_draft_tokens=spec.num_draft_tokens,
        num_accepted_tokens=spec.num_accepted_tokens,
        accepted_per_pos=spec.accepted_per_pos,
    )


async def start(settings: DecodeSettings, resources: contextlib.AsyncExitStack) -> Serving:
    """Load the engine and serve it."""
    trust = load_trust(settings.security)  # a bad file stops the start before the model loads
    engine, grammars = start_engine(settings, resources)
    view = None
    redis = settings.registry.redis
    if redis.redis_url:
        view = RegistryView(
            redis.redis_url, prefix=redis.redis_prefix, verifier=Verifier.following(trust.tokens)
        )
        await view.start()
        resources.push_async_callback(view.close)
    kvstores = KnownKVStores(settings.kvstore, view)
    metrics, worker_id = WorkerMetrics(engine, "decode"), new_worker_id("decode")
    nixl = open_endpoint(
        "decode", settings.transport, engine.info.layout, worker_id, view is not None, resources
    )
    servicer = DecodeServicer(
        engine,
        kvstores,
        trust,
        settings.kv_fetch_timeout,
        metrics,
        worker_id,
        grammars,
        nixl,
        view,
    )
    resources.push_async_callback(servicer.close)
    return await serve_engine(
        settings,
        resources,
        "decode",
        engine,
        lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, s),
        SERVICE_NAME,
        trust,
        metrics,
        worker_id,
        nixl.entry_fields() if nixl is not None else None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`pdserve decode`."""
    return run_service(
        "decode",
        DecodeSettings,
        argv,
        "Run a decode worker: it takes prefilled requests (their KV blocks from its own "
        "prefix cache, else from the kvstore, else recomputed) into its continuous batch and "
        "streams their tokens; it also prefills prompts sent without a first token.",
        start,
    )


if __name__ == "__main__":
    sys.exit(main())
