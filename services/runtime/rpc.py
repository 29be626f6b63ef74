"""gRPC servers and channels with deliberate limits: message sizes, keepalives, health,
reflection, and the cluster's internal trust (TLS, the internal token: ``trust``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.runtime.token_ring import TokenRing
from pdserve.runtime.trust import TokenCheck, Trust, token_interceptors
from pdserve.settings import variables

logger = logging.getLogger(__name__)

# KV payloads travel in messages of a few MiB; leave headroom well above that.
MAX_MESSAGE_BYTES = 64 * 2**20
# Bytes of block data per streamed message.
STREAM_CHUNK_BYTES = 4 * 2**20

# A peer that stops answering (its host gone, its process frozen) is cut off within
# keepalive time + timeout, 30 s by default, and its calls cancelled. grpc core times a
# keepalive ping out by ping_timeout_ms (default 60 s), not by keepalive_timeout_ms alone:
# both are set. PDSERVE_GRPC_KEEPALIVE_TIME_S and _TIMEOUT_S change the two for a process.


def _seconds_from_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.1 <= value <= 86_400:
        logger.warning(
            "%s=%r is not a number of seconds in [0.1, 86400]; using %g", name, raw, default
        )
        return default
    return value


KEEPALIVE_TIME_MS = int(1000 * _seconds_from_env(variables.GRPC_KEEPALIVE_TIME, 20.0))
KEEPALIVE_TIMEOUT_MS = int(1000 * _seconds_from_env(variables.GRPC_KEEPALIVE_TIMEOUT, 10.0))
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    # Without this, a second server on a taken port starts silently and shares it.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Peers ping as often as this process does (a shorter keepalive set on both sides).
    ("grpc.http2.min_ping_interval_without_data_ms", min(10_000, KEEPALIVE_TIME_MS)),
    *_KEEPALIVE,
]
# A channel that found its peer down waits before it dials again, 1 s growing 1.6x up to
# grpc's default of 120 s: a kvstore or worker restarted at the same address (a container
# restarted in its pod) would be skipped that long. Capped, it is dialled again within 2 s.
MAX_RECONNECT_BACKOFF_MS = 2_000
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    *_KEEPALIVE,
]


async def start_server(
    address: str,
    register: Iterable[Callable[[grpc.aio.Server], None]],
    service_names: Iterable[str],
    max_receive_bytes: int | None = None,
    *,
    credentials: grpc.ServerCredentials | None = None,
    token: TokenRing | str | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, int]:
    """Start an aio server on ``address`` ("127.0.0.1:0" picks a port) with the standard
    health service (every service SERVING) and server reflection. Returns (server, port).

    ``max_receive_bytes``: the largest request message (default MAX_MESSAGE_BYTES); a
    larger one gets RESOURCE_EXHAUSTED. ``credentials``: serve TLS only
    (``Trust.server_credentials``); ``token``: refuse calls without it, health excepted
    (``trust.TokenCheck``); ``interceptors`` run after that."""
    options = SERVER_OPTIONS
    if max_receive_bytes is not None:
        options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    checks = [TokenCheck(token)] if token else []
    server = grpc.aio.server(options=options, interceptors=[*checks, *interceptors])
    for add in register:
        add(server)
    names = list(service_names)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as e:  # grpcio raises this when the address is taken or invalid
        raise OSError(f"cannot bind {address}: is the port in use?") from e
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.health_servicer = health_servicer  # so a draining server can report NOT_SERVING
    return server, port


def aio_channel(address: str, trust: Trust | None = None) -> grpc.aio.Channel:
    """An aio channel with the project's message limits and keepalives; with ``trust``, it
    dials TLS where the trust says so and sends the internal token on every call."""
    if trust is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    interceptors = token_interceptors(trust.tokens)
    credentials = trust.current_channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(
            address, options=CHANNEL_OPTIONS, interceptors=interceptors
        )
    options = list(CHANNEL_OPTIONS)
    if trust.server_name:
        options.append(("grpc.ssl_target_name_override", trust.server_name))
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
