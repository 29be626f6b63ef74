"""Internal trust: the cluster's shared token, and TLS between pdserve's services.

A service started with an internal token refuses every call that does not carry it
(``authorization: Bearer <token>``) with UNAUTHENTICATED, except the standard health
service, which Kubernetes probes call without metadata. Server reflection is behind the
token like the services it describes. Channels made with a ``Trust`` send the token on
every call, and dial TLS when the process has a certificate or a CA to verify against.

Everything is read at start (``load_trust``, ``trust_files``): a missing file, or a key
that is not the certificate's, stops the start with a message naming the flag. The token
file and the TLS files are then followed as they rotate (``token_ring``, ``cert_watch``).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from pdserve.runtime.cert_watch import CertWatcher
from pdserve.runtime.token_ring import TokenRing
from pdserve.runtime.trust_files import TOKEN_ENV, read_trust_files
from pdserve.settings.process import InternalSecuritySettings

logger = logging.getLogger(__name__)

TOKEN_HEADER = "authorization"
# Methods anyone may call: probes send no metadata.
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_HOW_TO_SET = f"give the caller the cluster's internal token ({TOKEN_ENV} or --internal-token-file)"


@dataclass(frozen=True)
class Trust:
    """What a process needs to serve and to call its cluster's internal services."""

    token: str | None = field(default=None, repr=False)  # as read at start
    server_credentials: grpc.ServerCredentials | None = field(default=None, repr=False)
    channel_credentials: grpc.ChannelCredentials | None = field(default=None, repr=False)
    server_name: str | None = None
    mutual_tls: bool = False
    # The token as it rotates (None: no token); made from ``token`` when not given.
    tokens: TokenRing | None = field(default=None, repr=False)
    # The TLS files as they rotate (None: fixed credentials, or plaintext).
    certs: CertWatcher | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.tokens is None and self.token:
            object.__setattr__(self, "tokens", TokenRing(self.token))

    @property
    def serves_tls(self) -> bool:
        return self.server_credentials is not None

    @property
    def dials_tls(self) -> bool:
        return self.channel_credentials is not None

    def current_channel_credentials(self) -> grpc.ChannelCredentials | None:
        """The credentials a channel made now dials with (the rotated files' once they
        change)."""
        if self.certs is not None:
            return self.certs.channel_credentials()
        return self.channel_credentials

    @property
    def generation(self) -> int:
        """How many times the TLS files rotated: a channel made before the last rotation
        may be replaced by a new one."""
        if self.certs is None:
            return 0
        self.certs.check()
        return self.certs.generation

    def describe(self, server: bool = True) -> str:
        """One line for the start log (no secret in it); ``server``: whether this process
        serves internal calls (the gateway's public front is not one: it only dials)."""
        if not self.token:
            token = "no internal token"
        else:
            token = "internal token required" if server else "sends the internal token"
        tls = "mutual TLS" if self.mutual_tls else "TLS" if self.serves_tls else "plaintext"
        dial = "TLS" if self.dials_tls else "plaintext"
        return f"{token}; serves {tls}; dials {dial}" if server else f"{token}; dials {dial}"


def load_trust(settings: InternalSecuritySettings) -> Trust:
    """The trust ``settings`` describe, its files read and checked (``trust_files``);
    SettingsError naming the flag when one is missing or unusable."""
    files = read_trust_files(settings)
    certs = CertWatcher(settings, files) if settings.tls_cert or settings.tls_ca else None
    server_credentials = None
    if files.cert is not None:
        server_credentials = certs.server_credentials()
    channel_credentials = certs.channel_credentials() if certs is not None else None
    tokens = None
    if files.token:
        tokens = TokenRing(
            files.token, settings.internal_token_file, settings.internal_token_overlap
        )
    return Trust(
        token=files.token,
        tokens=tokens,
        certs=certs,
        server_credentials=server_credentials,
        channel_credentials=channel_credentials,
        server_name=settings.tls_server_name,
        mutual_tls=files.client_ca is not None,
    )


# -- the server side ------------------------------------------------------------------------


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses calls without the internal token (UNAUTHENTICATED), health calls excepted;
    during a rotation, the previous token too is accepted (``TokenRing``)."""

    def __init__(self, tokens: TokenRing | str) -> None:
        self._tokens = TokenRing(tokens) if isinstance(tokens, str) else tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        sent = [v for k, v in details.invocation_metadata or () if k == TOKEN_HEADER]
        if len(sent) == 1:
            given = _as_bytes(sent[0])
            matches = [
                hmac.compare_digest(given, f"Bearer {t}".encode()) for t in self._tokens.accepted()
            ]
            if any(matches):
                return handler
        reason = "wrong internal token" if sent else "no internal token"
        logger.warning("refused %s: %s", details.method, reason)
        return _refusal(handler, f"{reason}: this service requires it; {_HOW_TO_SET}")


def _as_bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts with UNAUTHENTICATED."""

    async def refuse(_request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    serde = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **serde)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **serde)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **serde)
    return grpc.unary_unary_rpc_method_handler(refuse, **serde)


# -- the client side ------------------------------------------------------------------------


class _SendsToken:
    def __init__(self, tokens: TokenRing) -> None:
        self._tokens = tokens

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        header = (TOKEN_HEADER, f"Bearer {self._tokens.sent()}")
        metadata = grpc.aio.Metadata(*(details.metadata or ()), header)
        return details._replace(metadata=metadata)


class _UnaryUnary(_SendsToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_SendsToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_SendsToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_SendsToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def token_interceptors(token: TokenRing | str | None) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that send ``token`` (as it rotates) on every kind of call (none
    without one)."""
    if not token:
        return []
    tokens = TokenRing(token) if isinstance(token, str) else token
    return [cls(tokens) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
