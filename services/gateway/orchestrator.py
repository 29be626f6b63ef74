"""One request's trip through the workers: Prefill on a prefill worker, then Decode.

Disaggregated, the prefill worker computes the prompt's KV blocks, pushes them to the
kvstore and samples the first token; the decode worker pulls the blocks and generates
the rest. Colocated, the decode worker does both. Either way the caller sees one
stream of ``DecodeResponse`` events, each token once, the first token first.

The decode stream repeats the prefill's first token (decode.proto: it carries every
generated token). The client gets that token as soon as the prefill answers, not after
the KV transfer, so the repeat is dropped here.
"""

from __future__ import annotations

import asyncio
import logging
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
from services.gateway.router import Router

logger = logging.getLogger(__name__)


class WorkerProtocolError(RuntimeError):
    """A worker broke the wire contract (a bug in the worker, not in the request)."""


class Orchestrator:
    """Runs requests on the workers its router picks, each gRPC call under a deadline."""

    def __init__(
        self,
        prefill_addrs: Sequence[str],
        decode_addrs: Sequence[str],
        disaggregation: bool,
        prefill_timeout_s: float = 60.0,
        decode_timeout_s: float = 600.0,
    ) -> None:
        self.router = Router(prefill_addrs, decode_addrs)
        self.disaggregation = disaggregation
        self.prefill_timeout_s = prefill_timeout_s
        self.decode_timeout_s = decode_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

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
        request = decode_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params
        )
        if self.disaggregation:
            prefill = await self._prefill(request_id, prompt_token_ids, params)
            yield first_token_event(prefill)
            if prefill.finish_reason:
                return
            _hand_over(prefill, request)
        address = self.router.pick_decode()
        stub = decode_pb2_grpc.DecodeStub(self._channel(address))
        logger.debug("request %s: Decode on %s", request_id, address)
        call = stub.Decode(request, timeout=self.decode_timeout_s)
        repeats_first = request.HasField("first_token_id")
        try:
            async for response in call:
                if repeats_first and response.token_ids:
                    response = _without_first_token(response, request.first_token_id, address)
                    repeats_first = False
                yield response
                if response.finish_reason:
                    return
        finally:
            # A no-op when the call is over; otherwise the worker sees the cancellation
            # and frees the request's blocks.
            call.cancel()
        raise WorkerProtocolError(
            f"decode worker {address} ended request {request_id}'s stream without a finish_reason"
        )

    async def close(self) -> None:
        """Close every channel (cancelling calls still running on them)."""
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(channel.close() for channel in channels))

    async def _prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: common_pb2.SamplingParams,
    ) -> prefill_pb2.PrefillResponse:
        address = self.router.pick_prefill()
        stub = prefill_pb2_grpc.PrefillStub(self._channel(address))
        logger.debug("request %s: Prefill on %s", request_id, address)
        request = prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params
        )
        call = stub.Prefill(request, timeout=self.prefill_timeout_s)
        try:
            return await call
        except asyncio.CancelledError:
            call.cancel()
            raise

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = aio_channel(address)
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


def _without_first_token(
    response: decode_pb2.DecodeResponse, first_token_id: int, address: str
) -> decode_pb2.DecodeResponse:
    """``response`` less its first token, which the client already has from the prefill."""
    if response.token_ids[0] != first_token_id:
        raise WorkerProtocolError(
            f"decode worker {address} began its stream with token {response.token_ids[0]}, "
            f"not the prefill's first token {first_token_id}"
        )
    trimmed = decode_pb2.DecodeResponse()
    trimmed.CopyFrom(response)
    del trimmed.token_ids[0]
    if trimmed.logprobs:
        del trimmed.logprobs[0]
    return trimmed
