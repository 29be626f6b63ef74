"""One request's trip through the workers: Prefill on a prefill worker, then Decode.

Disaggregated, the prefill worker computes the prompt's KV blocks, pushes them to the
kvstore and samples the first token; the decode worker pulls the blocks and generates
the rest. Colocated, the decode worker does both. Either way the caller sees one
stream of ``DecodeResponse`` events, each token once, the first token first: the
prefill's first token goes to the client as soon as the prefill answers, and the decode
stream carries only the tokens after it (decode.proto).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import grpc

from services.common.grpc_utils import aio_channel
from services.common.pb import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.common.trust import Trust
from services.gateway.router import NoWorkerError, Route, Router

logger = logging.getLogger(__name__)


class WorkerProtocolError(RuntimeError):
    """A worker broke the wire contract (a bug in the worker, not in the request)."""


class Orchestrator:
    """Runs requests on the workers its router picks, each gRPC call under a deadline.

    A call that cannot reach its worker (UNAVAILABLE before any answer: the worker died
    or is draining) is retried on another worker of the pool, up to ``max_attempts``.
    """

    def __init__(
        self,
        router: Router,
        disaggregation: bool,
        prefill_timeout_s: float = 60.0,
        decode_timeout_s: float = 600.0,
        local_prefill_threshold: int = 0,
        max_attempts: int = 3,
        trust: Trust | None = None,
    ) -> None:
        """``trust``: how calls reach the workers (TLS, the internal token)."""
        self.router = router
        self.disaggregation = disaggregation
        self.prefill_timeout_s = prefill_timeout_s
        self.decode_timeout_s = decode_timeout_s
        self.local_prefill_threshold = local_prefill_threshold
        self.max_attempts = max_attempts
        self.counters: Counter[str] = Counter()  # prefill_remote, prefill_local, retries
        self.trust = trust
        self._channels: dict[str, grpc.aio.Channel] = {}

    @classmethod
    def with_addresses(
        cls,
        prefill_addrs: Sequence[str],
        decode_addrs: Sequence[str],
        disaggregation: bool,
        **options,
    ) -> Orchestrator:
        """An orchestrator over fixed worker addresses (no registry)."""
        from services.gateway.router import StaticPools

        return cls(Router(StaticPools(prefill_addrs, decode_addrs)), disaggregation, **options)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: common_pb2.SamplingParams,
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """The request's output as events: new token ids (and logprobs), the last with a
        finish_reason. Closing the iterator, or cancelling its consumer, cancels the
        decode call. A worker's gRPC error is raised as it came (``grpc.aio.AioRpcError``).
        """
        prompt = list(prompt_token_ids)
        request = decode_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=prompt, params=params
        )
        route = await self.router.pick("decode", prompt)
        # Conditional disaggregation: a prompt whose uncached part on the chosen decode
        # worker is short is cheaper to prefill there than to prefill and transfer.
        uncached = len(prompt) - route.cached_tokens
        if self.disaggregation and uncached >= self.local_prefill_threshold:
            self.counters["prefill_remote"] += 1
            prefill = await self._prefill(request_id, prompt, params)
            yield first_token_event(prefill)
            if prefill.finish_reason:
                return
            _hand_over(prefill, request)
        else:
            self.counters["prefill_local"] += 1
        async for event in self._decode(request, route, prompt):
            yield event

    async def _decode(
        self, request: decode_pb2.DecodeRequest, route: Route, prompt: list[int]
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        tried: set[str] = set()
        while True:
            answered = False
            try:
                async with contextlib.aclosing(self._decode_on(request, route)) as events:
                    async for response in events:
                        answered = True
                        yield response
                return
            except grpc.aio.AioRpcError as error:
                tried.add(route.worker.worker_id)
                route = await self._retry_route("decode", error, answered, route, prompt, tried)

    async def _decode_on(
        self, request: decode_pb2.DecodeRequest, route: Route
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        address = route.address
        stub = decode_pb2_grpc.DecodeStub(self._channel(address))
        logger.debug("request %s: Decode on %s", request.request_id, address)
        with self.router.track(route):
            call = stub.Decode(request, timeout=self.decode_timeout_s)
            try:
                async for response in call:
                    yield response
                    if response.finish_reason:
                        return
            finally:
                # A no-op when the call is over; otherwise the worker sees the cancellation
                # and frees the request's blocks.
                call.cancel()
        raise WorkerProtocolError(
            f"decode worker {address} ended request {request.request_id}'s stream without a "
            "finish_reason"
        )

    async def _retry_route(
        self,
        role: str,
        error: grpc.aio.AioRpcError,
        answered: bool,
        route: Route,
        prompt: list[int],
        tried: set[str],
    ) -> Route:
        """Another worker for a call that failed to reach ``route``; re-raise ``error`` when
        the failure is not a connection failure, the worker had answered, or none is left."""
        if (
            answered
            or error.code() != grpc.StatusCode.UNAVAILABLE
            or len(tried) >= (self.max_attempts)
        ):
            raise error
        self.router.mark_unreachable(route)
        try:
            retry = await self.router.pick(role, prompt, exclude=frozenset(tried))
        except NoWorkerError:
            raise error from None
        self.counters["retries"] += 1
        logger.warning(
            "%s worker %s unreachable (%s); retrying on %s",
            role,
            route.address,
            error.details(),
            retry.address,
        )
        return retry

    async def close(self) -> None:
        """Close every channel (cancelling calls still running on them)."""
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(channel.close() for channel in channels))

    async def _prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: common_pb2.SamplingParams,
    ) -> prefill_pb2.PrefillResponse:
        request = prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, params=params
        )
        route = await self.router.pick("prefill", prompt)
        tried: set[str] = set()
        while True:
            try:
                return await self._prefill_on(request, route)
            except grpc.aio.AioRpcError as error:
                tried.add(route.worker.worker_id)
                route = await self._retry_route("prefill", error, False, route, prompt, tried)

    async def _prefill_on(
        self, request: prefill_pb2.PrefillRequest, route: Route
    ) -> prefill_pb2.PrefillResponse:
        stub = prefill_pb2_grpc.PrefillStub(self._channel(route.address))
        logger.debug("request %s: Prefill on %s", request.request_id, route.address)
        with self.router.track(route):
            call = stub.Prefill(request, timeout=self.prefill_timeout_s)
            try:
                return await call
            except asyncio.CancelledError:
                call.cancel()
                raise

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = aio_channel(address, self.trust)
        return self._channels[address]


def first_token_event(prefill: prefill_pb2.PrefillResponse) -> decode_pb2.DecodeResponse:
    """The prefill worker's first token as the stream's first event."""
    event = decode_pb2.DecodeResponse(
        token_ids=[prefill.first_token_id],
        finish_reason=prefill.finish_reason,
        num_cached_tokens=prefill.num_cached_tokens,
    )
    if prefill.HasField("first_logprob"):
        event.logprobs.append(prefill.first_logprob)
    return event


def _hand_over(prefill: prefill_pb2.PrefillResponse, request: decode_pb2.DecodeRequest) -> None:
    """Fill ``request`` with what the decode worker needs from the prefill."""
    request.first_token_id = prefill.first_token_id
    if prefill.HasField("first_logprob"):
        request.first_logprob.CopyFrom(prefill.first_logprob)
    request.block_keys.extend(prefill.block_keys)
    request.kvstore_address = prefill.kvstore_address
    request.layout.CopyFrom(prefill.layout)
    request.block_kvstore_addresses.extend(prefill.block_kvstore_addresses)
