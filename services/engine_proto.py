"""Glue between the engine's types and the wire messages, for the prefill and decode workers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import grpc

from services.common.pb import common_pb2
from services.engine.kv_transfer import BlockLayout
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import TokenLogprobs

DEFAULT_MAX_TOKENS = 256


def sampling_from_proto(p: common_pb2.SamplingParams, **override) -> SamplingParams:
    """proto3 zero values mean "unset": max_tokens 0 -> 256, top_p 0 -> 1, top_k 0 -> off,
    repetition_penalty 0 -> 1 (off); any other value is checked as given.

    Raises ValueError (naming the parameter) for nonsense values."""
    kwargs = dict(
        max_tokens=p.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=p.temperature,
        top_k=p.top_k or -1,
        top_p=p.top_p or 1.0,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        min_tokens=p.min_tokens,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
    )
    kwargs.update(override)
    return SamplingParams(**kwargs)


def logprob_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=lp.top)


def logprob_from_proto(lp: common_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top=dict(lp.top))


def layout_to_proto(layout: BlockLayout) -> common_pb2.BlockLayout:
    return common_pb2.BlockLayout(
        version=layout.version,
        model_fingerprint=layout.model_fingerprint,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
    )


def layout_from_proto(p: common_pb2.BlockLayout) -> BlockLayout:
    return BlockLayout(
        version=p.version,
        model_fingerprint=p.model_fingerprint,
        dtype=p.dtype,
        block_size=p.block_size,
        num_layers=p.num_layers,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
    )


async def abort_invalid(context: grpc.aio.ServicerContext, error: ValueError) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


def add_server_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=default_port, help="port; 0 picks a free one")


def run_until_signal(main_coro_factory) -> int:
    """Run an async server until SIGTERM/SIGINT, then let it drain; exit code 0."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main_coro_factory(stop)

    try:
        asyncio.run(runner())
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    return 0
