"""How the REST front answers over time: an SSE response that stops its generations and frees
its admission slot however it ends, and a whole answer cancelled when its client leaves."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pdserve.gateway.admission import Admission
from pdserve.gateway.generation import REQUEST_ERRORS
from pdserve.gateway.openai_errors import api_error_of
from pdserve.gateway.telemetry import RequestTelemetry
from pdserve.v1 import gateway_pb2

logger = logging.getLogger(__name__)


async def first_message(
    chunks: AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]],
) -> tuple[int, gateway_pb2.GenerateResponse]:
    """The first message of ``chunks``; closes them and raises the APIError if it fails."""
    try:
        return await anext(chunks)
    except REQUEST_ERRORS as error:
        await chunks.aclose()
        raise api_error_of(error) from None
    except BaseException:
        await chunks.aclose()
        raise


async def prepend(
    first: tuple[int, gateway_pb2.GenerateResponse],
    chunks: AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]],
) -> AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]]:
    async with aclosing(chunks):
        yield first
        async for item in chunks:
            yield item


class _ClientStalled(Exception):
    """The client stopped reading its stream."""


class SSEResponse(StreamingResponse):
    """An SSE stream that, however it ends, stops its generations and frees its slot.

    A client that stops reading fills the socket's buffers and then every send waits; one
    that waits longer than ``send_timeout_s`` ends the stream (its connection is closed).
    """

    def __init__(
        self,
        events: AsyncIterator[str],
        admission: Admission,
        chunks: AsyncGenerator,
        send_timeout_s: float,
        telemetry: RequestTelemetry,
    ) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._admission = admission
        self._chunks = chunks
        self._send_timeout_s = send_timeout_s
        self._telemetry = telemetry

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_or_give_up(message: dict) -> None:
            try:
                async with asyncio.timeout(self._send_timeout_s):
                    await send(message)
            except TimeoutError:
                raise _ClientStalled from None

        try:
            await super().__call__(scope, receive, send_or_give_up)
        except _ClientStalled as error:
            logger.warning(
                "request %s: the client read nothing for %gs (--send-timeout); stream cancelled",
                scope.get("state", {}).get("request_id"),
                self._send_timeout_s,
            )
            self._telemetry.end(error)
        finally:
            try:
                await self._chunks.aclose()  # a stream never iterated still runs them
            finally:
                self._admission.release()
                self._telemetry.end()


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result, cancelling it (and so its generations) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return {}  # nobody is listening
    return task.result()
