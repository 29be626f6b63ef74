"""A prepared request run to text: the one path from token events to output, for every front.

Both the gRPC servicer and the OpenAI REST handlers read their output from ``generate``:
messages with new token ids, new text and logprobs, the last with finish_reason and usage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

import grpc

from pdserve.core.finish_reason import FinishReason
from pdserve.gateway.detokenizer import IncrementalDetokenizer
from pdserve.gateway.orchestrator import Orchestrator, StreamStalled, WorkerProtocolError
from pdserve.gateway.requests import InvalidRequest, PreparedRequest
from pdserve.gateway.router import NoWorkerError
from pdserve.gateway.stop import StopChecker
from pdserve.gateway.telemetry import RequestTelemetry
from pdserve.v1 import common_pb2, decode_pb2, gateway_pb2
from pdserve.wire.convert import finish_reason_from_proto, finish_reason_to_proto

logger = logging.getLogger(__name__)

# What a request can meet on its way; anything else is a bug in the gateway.
REQUEST_ERRORS = (
    InvalidRequest,
    grpc.aio.AioRpcError,
    NoWorkerError,
    StreamStalled,
    WorkerProtocolError,
)


async def generate(
    orchestrator: Orchestrator,
    tokenizer: Any,
    request: PreparedRequest,
    telemetry: RequestTelemetry,
) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Messages with new tokens and text; the last has finish_reason and usage.

    A stop string ends the stream as STOP and cancels the generation upstream, and so
    does closing the iterator or cancelling its consumer. ``telemetry``: the request this
    is a choice of (its clock, span and metrics).
    """
    detokenizer = IncrementalDetokenizer(
        tokenizer, request.prompt_token_ids, request.skip_special_tokens
    )
    stop = StopChecker(list(request.stop), include=request.include_stop_str_in_output)
    usage = common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids))
    clock = telemetry.choice()
    last, reason, last_token = None, None, None
    moves: list[str] = []
    events = orchestrator.generate(
        request.request_id, request.prompt_token_ids, request.params, moves, telemetry.span
    )
    async with aclosing(events):
        async for event in events:
            if event.token_ids:
                last_token = event.token_ids[-1]
            if event.token_ids:
                clock.tokens()
            usage.completion_tokens += len(event.token_ids)
            if event.HasField("spec") and telemetry.metrics is not None:
                telemetry.metrics.count_spec(event.spec)
            usage.cached_prompt_tokens = max(usage.cached_prompt_tokens, event.num_cached_tokens)
            text, stopped = stop.feed(detokenizer.add(list(event.token_ids)))
            upstream = _finish_reason(request, event)
            if upstream and not stopped:
                tail, stopped = stop.feed(detokenizer.finish())
                text += tail if stopped else tail + stop.flush()
            chunk = gateway_pb2.GenerateResponse(
                request_id=request.reply_id, token_ids=event.token_ids, text=text
            )
            if request.wants_logprobs:
                chunk.logprobs.extend(event.logprobs)
            chunk.prompt_logprobs.extend(event.prompt_logprobs)  # on the first with tokens
            if stopped or upstream:
                reason = FinishReason.STOP if stopped else upstream
                chunk.finish_reason = finish_reason_to_proto(reason)
                if stop.matched is not None:
                    chunk.stop_string = stop.matched
                elif reason is FinishReason.STOP and last_token in request.params.stop_token_ids:
                    chunk.stop_token_id = last_token
                last = chunk
                break  # leaving `async with` cancels the decode call if it still runs
            if chunk.token_ids or chunk.text or chunk.prompt_logprobs:
                yield chunk
    if last is None:
        raise WorkerProtocolError(f"request {request.request_id} ended without a finish_reason")
    last.usage.CopyFrom(usage)
    ttft, e2e = clock.finish(usage, reason)
    logger.info(
        "request %s%s: %d prompt tokens (%d cached), %d generated, finish %s, "
        "TTFT %s, e2e %.1f ms, on %s",
        request.request_id,
        f" (client id {request.client_request_id!r})" if request.client_request_id else "",
        usage.prompt_tokens,
        usage.cached_prompt_tokens,
        usage.completion_tokens,
        reason,
        "-" if ttft is None else f"{ttft * 1e3:.1f} ms",
        e2e * 1e3,
        " -> ".join(moves),
        extra=log_ids(request.request_id, telemetry.trace_id),
    )
    yield last


def _finish_reason(
    request: PreparedRequest, event: decode_pb2.DecodeResponse
) -> FinishReason | None:
    """The finish reason a worker's message carries, if any."""
    try:
        return finish_reason_from_proto(event.finish_reason)
    except ValueError as error:
        raise WorkerProtocolError(f"request {request.request_id}: {error}") from None


def log_ids(request_id: str, trace_id: str) -> dict[str, str]:
    """A log record's ids: the request's, and its trace's when it is traced."""
    return {"request_id": request_id, **({"trace_id": trace_id} if trace_id else {})}


async def generate_many(
    orchestrator: Orchestrator,
    tokenizer: Any,
    requests: Sequence[PreparedRequest],
    telemetry: RequestTelemetry,
) -> AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]]:
    """``generate`` for several requests at once: (index, message) as each arrives.

    The first error ends the whole stream; leaving it early cancels every generation.
    """
    queue: asyncio.Queue[tuple[int, gateway_pb2.GenerateResponse | None, Exception | None]]
    queue = asyncio.Queue()

    async def pump(index: int, request: PreparedRequest) -> None:
        try:
            async with aclosing(generate(orchestrator, tokenizer, request, telemetry)) as chunks:
                async for chunk in chunks:
                    await queue.put((index, chunk, None))
        except Exception as error:  # handed to the consumer, which raises it
            await queue.put((index, None, error))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            index, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
            else:
                yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
