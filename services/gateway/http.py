"""Uvicorn inside the gateway's own event loop, next to the gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry

from pdserve.gateway.public_tls import PublicTLS
from pdserve.runtime.metrics import CONTENT_TYPE, exposition

logger = logging.getLogger(__name__)

# A connection's kernel send buffer: ample for token streams and JSON answers, and without
# it loopback and LAN connections autotune to megabytes per slow reader.
SEND_BUFFER_BYTES = 128 * 1024


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to the gateway, which stops it on SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """An ASGI app served on a socket bound before start, so a taken port fails at once."""

    def __init__(self, server: _Server, task: asyncio.Task, port: int) -> None:
        self._server = server
        self._task = task
        self.port = port

    @classmethod
    async def start(
        cls,
        app: Any,
        host: str,
        port: int,
        drain_timeout_s: float,
        tls: PublicTLS | None = None,
    ) -> HttpServer:
        """Bind ``host:port`` (0: any free port) and serve ``app`` until ``stop``; HTTPS with
        ``tls``'s pair, which it follows as it rotates."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if host == "::":  # the IPv6 wildcard takes IPv4 clients too, whatever the sysctl
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # Inherited by every connection: what a client that stops reading can leave queued
        # in the kernel before its sends wait (and --send-timeout ends its stream).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        try:
            sock.bind((host, port))
        except OSError as error:
            sock.close()
            raise OSError(f"--http-port {port}: cannot listen on {host}:{port}: {error}") from None
        sock.listen(2048)
        config = uvicorn.Config(
            app,
            log_config=None,  # the gateway's logging
            access_log=False,
            timeout_graceful_shutdown=drain_timeout_s,
            lifespan="off",
            ssl_certfile=tls.certfile if tls else None,
            ssl_keyfile=tls.keyfile if tls else None,
        )
        server = _Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        if tls is not None:
            follow = asyncio.create_task(tls.follow(server.config.ssl))
            task.add_done_callback(lambda _: follow.cancel())
        return cls(server, task, sock.getsockname()[1])

    async def stop(self) -> None:
        """Stop accepting, give running requests the drain timeout, then close."""
        self._server.should_exit = True
        await self._task


def metrics_app(registry: CollectorRegistry, healthy: Callable[[], bool]) -> Callable:
    """The ASGI app of ``--metrics-port``: GET /metrics (``registry`` as Prometheus text)
    and GET /health (200 while ``healthy()``, then 503), nothing else (404)."""

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        if path == "/metrics":
            status, kind, body = 200, CONTENT_TYPE, exposition(registry)
        elif path == "/health":
            ok = healthy()
            status, kind = (200 if ok else 503), "text/plain; charset=utf-8"
            body = b"SERVING\n" if ok else b"NOT_SERVING\n"
        else:
            status, kind, body = 404, "text/plain; charset=utf-8", b"not found\n"
        headers = [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app
