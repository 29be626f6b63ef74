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
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc

from pdserve.gateway.router import NoWorkerError, Route, Router
from pdserve.runtime import tracing
from pdserve.runtime.rpc import aio_channel
from pdserve.runtime.trust import Trust
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


class WorkerProtocolError(RuntimeError):
    """A worker broke the wire contract (a bug in the worker, not in the request)."""


class StreamStalled(RuntimeError):
    """A decode stream sent nothing for the idle timeout (its worker hangs)."""


# A decode stream that breaks with one of these is the request's own doing (a bad value, a
# layout or kvstore refused) or out of its time budget: moving it would fail again.
_FINAL = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
# A prefill that fails with one of these is not tried on the decode worker instead.
_NO_FALLBACK = _FINAL - {grpc.StatusCode.DEADLINE_EXCEEDED}


class Orchestrator:
    """Runs requests on the workers its router picks, each gRPC call under a deadline.

    A call that cannot reach its worker (UNAVAILABLE before any answer: the worker died
    or is draining), or a decode stream that sends nothing for ``stream_idle_timeout_s``
    before the client has a token, is retried on another worker of the pool, up to
    ``max_attempts``.
    A decode stream that breaks after the client has tokens (its worker died, hangs past
    ``stream_idle_timeout_s``, or failed) **migrates**: another decode worker gets the
    prompt and the tokens so far and continues the stream, the client sees no gap and no
    repeat, and greedy or seeded output is what the unbroken stream would have been; at
    most ``migration_limit`` times a request. A prefill that no prefill worker can do
    falls back to the decode worker.
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
        migration_limit: int = 3,
        stream_idle_timeout_s: float = 30.0,
        migration_wait_s: float = 60.0,
    ) -> None:
        """``trust``: how calls reach the workers (TLS, the internal token)."""
        self.migration_limit = migration_limit
        self.migration_wait_s = migration_wait_s
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.router = router
        self.disaggregation = disaggregation
        self.prefill_timeout_s = prefill_timeout_s
        self.decode_timeout_s = decode_timeout_s
        self.local_prefill_threshold = local_prefill_threshold
        self.max_attempts = max_attempts
        # prefill_remote, prefill_local, prefill_fallback, retries, migrations:<reason>
        self.counters: Counter[str] = Counter()
        self.trust = trust
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._generations: dict[str, int] = {}  # the TLS files' generation each dials with
        self._retired: list[grpc.aio.Channel] = []  # replaced after a rotation: calls run on

    @classmethod
    def with_addresses(
        cls,
        prefill_addrs: Sequence[str],
        decode_addrs: Sequence[str],
        disaggregation: bool,
        **options,
    ) -> Orchestrator:
        """An orchestrator over fixed worker addresses (no registry)."""
        from pdserve.gateway.router import StaticPools

        return cls(Router(StaticPools(prefill_addrs, decode_addrs)), disaggregation, **options)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: common_pb2.SamplingParams,
        moves: list[str] | None = None,
        span: Any = tracing.NO_SPAN,
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """The request's output as events: new token ids (and logprobs), the last with a
        finish_reason. Closing the iterator, or cancelling its consumer, cancels the
        decode call. A worker's gRPC error is raised as it came (``grpc.aio.AioRpcError``).
        ``moves``: where the request ran is appended to it ("prefill@ADDR", "decode@ADDR",
        one entry per worker), for its log line. ``span``: the request's; each routing
        decision and worker call is a child span, and the calls carry its trace.
        """
        moves = [] if moves is None else moves
        prompt = list(prompt_token_ids)
        request = decode_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=prompt, params=params
        )
        with tracing.start_span("gateway.route", span):
            route = await self.router.pick("decode", prompt)
        # Conditional disaggregation: a prompt whose uncached part on the chosen decode
        # worker is short is cheaper to prefill there than to prefill and transfer.
        uncached = len(prompt) - route.cached_tokens
        if self.disaggregation and uncached >= self.local_prefill_threshold:
            try:
                # The decode worker reads the blocks over NIXL if its entry offers it.
                nixl = bool(route.worker.nixl_agent)
                prefill = await self._prefill(request_id, prompt, params, moves, span, nixl)
            except (grpc.aio.AioRpcError, NoWorkerError) as error:
                if isinstance(error, grpc.aio.AioRpcError) and error.code() in _NO_FALLBACK:
                    raise
                # No prefill worker could: the decode worker prefills it itself.
                self.counters["prefill_fallback"] += 1
                logger.warning(
                    "request %s: no prefill worker answered (%s); prefilling on decode worker %s",
                    request_id,
                    _describe(error),
                    route.address,
                )
            else:
                self.counters["prefill_remote"] += 1
                yield first_token_event(prefill)
                if prefill.finish_reason:
                    return
                _hand_over(prefill, request)
        else:
            self.counters["prefill_local"] += 1
        async for event in self._decode(request, route, prompt, moves, span):
            yield event

    async def _decode(
        self,
        request: decode_pb2.DecodeRequest,
        route: Route,
        prompt: list[int],
        moves: list[str],
        span: Any = tracing.NO_SPAN,
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        tried: set[str] = set()
        unreachable: set[str] = set()  # workers this request found dead: never again
        generated: list[int] = []  # the tokens the decode streams delivered so far
        migrations = 0
        call = request
        while True:
            moves.append(f"decode@{route.address}")
            try:
                async with contextlib.aclosing(self._decode_on(call, route, span)) as events:
                    async for response in events:
                        generated.extend(response.token_ids)
                        yield response
                return
            except (grpc.aio.AioRpcError, WorkerProtocolError, StreamStalled) as error:
                tried.add(route.worker.worker_id)
                client_has_tokens = bool(generated) or request.HasField("first_token_id")
                if not client_has_tokens:
                    route = await self._retry_route("decode", error, False, route, prompt, tried)
                    continue
                reason = _migration_reason(error)
                if reason in ("unavailable", "stalled"):
                    # Registry pools skip it until it heartbeats again: a frozen process
                    # does not, a worker that is only slow does at once.
                    self.router.mark_unreachable(route)
                if reason == "unavailable":
                    unreachable.add(route.worker.worker_id)
                if reason is None or migrations >= self.migration_limit:
                    raise
                exclude = frozenset({route.worker.worker_id, *unreachable})
                moved = await self._migration_target(prompt, exclude, error)
                migrations += 1
                self.counters[f"migrations:{reason}"] += 1
                logger.warning(
                    "request %s: decode stream on %s broke after %d tokens (%s: %s); "
                    "migrating it to %s",
                    request.request_id,
                    route.address,
                    len(generated) + request.HasField("first_token_id"),
                    reason,
                    _describe(error),
                    moved.address,
                )
                span.add_event(
                    "migration",
                    {
                        "pdserve.reason": reason,
                        "pdserve.from": route.address,
                        "pdserve.to": moved.address,
                    },
                )
                route, call = moved, _resumed(request, generated)

    async def _migration_target(
        self, prompt: list[int], exclude: frozenset[str], error: Exception
    ) -> Route:
        """Another decode worker for a broken stream, not one of ``exclude`` (the one it
        broke on, those it found dead); one it left frozen or failing may take it back
        once the router lists it again. With none, wait up to ``migration_wait_s`` for
        one (a supervisor restarting the only one), then raise ``error``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.migration_wait_s
        while True:
            try:
                return await self.router.pick("decode", prompt, exclude=exclude)
            except NoWorkerError:
                if loop.time() >= deadline:
                    raise error from None
                await asyncio.sleep(0.25)

    async def _decode_on(
        self, request: decode_pb2.DecodeRequest, route: Route, parent: Any = tracing.NO_SPAN
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        address = route.address
        stub = decode_pb2_grpc.DecodeStub(self._channel(address))
        logger.debug("request %s: Decode on %s", request.request_id, address)
        span = _call_span("gateway.decode", parent, route)
        with self.router.track(route), _ended(span):
            metadata = tracing.grpc_metadata(span)
            call = stub.Decode(request, timeout=self.decode_timeout_s, metadata=metadata)
            responses = call.__aiter__()
            try:
                while True:
                    try:
                        async with asyncio.timeout(self.stream_idle_timeout_s):
                            response = await anext(responses)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        raise StreamStalled(
                            f"decode worker {address} sent nothing for "
                            f"{self.stream_idle_timeout_s:g}s (--stream-idle-timeout)"
                        ) from None
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
        error: Exception,
        answered: bool,
        route: Route,
        prompt: list[int],
        tried: set[str],
    ) -> Route:
        """Another worker for a call that got nothing from ``route``: it was unreachable
        (UNAVAILABLE) or hung past the idle timeout (``StreamStalled``); re-raise ``error``
        for any other failure, when the worker had answered, or when none is left."""
        unreachable = (
            isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
        )
        if (
            answered
            or not (unreachable or isinstance(error, StreamStalled))
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
            "%s worker %s gave no answer (%s); retrying on %s",
            role,
            route.address,
            _describe(error),
            retry.address,
        )
        return retry

    async def close(self) -> None:
        """Close every channel (cancelling calls still running on them)."""
        channels, self._channels = [*self._channels.values(), *self._retired], {}
        self._retired = []
        await asyncio.gather(*(channel.close() for channel in channels))

    async def _prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: common_pb2.SamplingParams,
        moves: list[str],
        span: Any = tracing.NO_SPAN,
        decode_reads_nixl: bool = False,
    ) -> prefill_pb2.PrefillResponse:
        request = prefill_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            decode_reads_nixl=decode_reads_nixl,
        )
        with tracing.start_span("gateway.route", span):
            route = await self.router.pick("prefill", prompt)
        tried: set[str] = set()
        while True:
            moves.append(f"prefill@{route.address}")
            try:
                return await self._prefill_on(request, route, span)
            except grpc.aio.AioRpcError as error:
                tried.add(route.worker.worker_id)
                route = await self._retry_route("prefill", error, False, route, prompt, tried)

    async def _prefill_on(
        self, request: prefill_pb2.PrefillRequest, route: Route, parent: Any = tracing.NO_SPAN
    ) -> prefill_pb2.PrefillResponse:
        stub = prefill_pb2_grpc.PrefillStub(self._channel(route.address))
        logger.debug("request %s: Prefill on %s", request.request_id, route.address)
        span = _call_span("gateway.prefill", parent, route)
        with self.router.track(route), _ended(span):
            metadata = tracing.grpc_metadata(span)
            call = stub.Prefill(request, timeout=self.prefill_timeout_s, metadata=metadata)
            try:
                return await call
            except asyncio.CancelledError:
                call.cancel()
                raise

    def _channel(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address``; a new one once the TLS files rotated (the old one's
        calls run on, and it closes with the others)."""
        generation = self.trust.generation if self.trust is not None else 0
        held = self._channels.get(address)
        if held is not None and self._generations.get(address) == generation:
            return held
        if held is not None:
            self._retired.append(held)
        self._channels[address] = aio_channel(address, self.trust)
        self._generations[address] = generation
        return self._channels[address]


def _call_span(name: str, parent: Any, route: Route) -> Any:
    """The client span of one call to ``route``'s worker."""
    span = tracing.start_span(name, parent, kind=tracing.CLIENT)
    if span.is_recording():
        span.set_attributes(
            {
                "pdserve.worker.id": route.worker.worker_id,
                "pdserve.worker.address": route.address,
                "pdserve.route.cached_tokens": route.cached_tokens,
            }
        )
    return span


@contextlib.contextmanager
def _ended(span: Any) -> Iterator[None]:
    """End ``span`` when the block ends: failed by a worker's error, plainly otherwise
    (the caller closing the stream early, a stop string, is no failure)."""
    try:
        yield
    except (grpc.aio.AioRpcError, WorkerProtocolError, StreamStalled) as error:
        tracing.end_error(span, error)
        raise
    except BaseException:
        span.set_attribute("pdserve.cancelled", True)
        span.end()
        raise
    span.end()


def _migration_reason(error: Exception) -> str | None:
    """Why a broken decode stream moves ("unavailable", "stalled", "error"), or None when
    it must not (the request's own fault or deadline)."""
    if isinstance(error, StreamStalled):
        return "stalled"
    if isinstance(error, WorkerProtocolError):
        return "error"
    if error.code() in _FINAL:
        return None
    return "unavailable" if error.code() == grpc.StatusCode.UNAVAILABLE else "error"


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name} {error.details() or ''}".strip()
    return str(error)


def _resumed(request: decode_pb2.DecodeRequest, generated: list[int]) -> decode_pb2.DecodeRequest:
    """``request`` continued after ``generated`` (the tokens its decode streams delivered):
    the prefill's hand-over stays (its blocks may still be in the kvstore), and the tokens
    the client has become the new worker's output so far."""
    resumed = decode_pb2.DecodeRequest()
    resumed.CopyFrom(request)
    if request.HasField("first_token_id"):
        resumed.resume_token_ids.extend(generated)
    elif generated:  # colocated: the first generated token plays the prefill's part
        resumed.first_token_id = generated[0]
        resumed.resume_token_ids.extend(generated[1:])
    return resumed


def first_token_event(prefill: prefill_pb2.PrefillResponse) -> decode_pb2.DecodeResponse:
    """The prefill worker's first token as the stream's first event."""
    event = decode_pb2.DecodeResponse(
        token_ids=[prefill.first_token_id],
        finish_reason=prefill.finish_reason,
        num_cached_tokens=prefill.num_cached_tokens,
        prompt_logprobs=prefill.prompt_logprobs,
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
    if prefill.HasField("nixl"):
        request.nixl.CopyFrom(prefill.nixl)
