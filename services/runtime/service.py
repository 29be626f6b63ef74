"""``run_service``: how every pdserve service starts, announces itself and stops.

A service supplies its settings class and an async ``start`` that builds what it serves
and returns a ``Serving``. ``run_service`` does the rest, the same for all: flags and
``PDSERVE_*`` variables into settings (exit 2 naming a bad one), logging (text or JSON),
a warning for unknown ``PDSERVE_*`` variables, tracing (``TracingSettings``; its last
spans sent on the way out), SIGTERM/SIGINT, registration in the
registry, the ``READY <name> HOST:PORT`` line launchers wait for, and on a signal the
drain: deregister first (gateways drop the worker at once), report NOT_SERVING, let
running calls finish for ``--drain-timeout`` seconds, then release every resource
``start`` registered, last made first. A service whose ``Serving.watch`` returns (a
worker's engine died) leaves the same way, with a short grace, and exits 3: it cannot
serve any more, and its supervisor (Kubernetes, `pdserve up`) starts a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from pdserve.controlplane.publisher import RegistryPublisher
from pdserve.runtime import tracing
from pdserve.runtime.logs import configure_logging
from pdserve.settings.commands import known_env
from pdserve.settings.flags import parse_settings, warn_unknown_env
from pdserve.settings.process import host_port

logger = logging.getLogger(__name__)

S = TypeVar("S")
# Between deregistering and refusing calls: time for gateways to hear the "down" event.
DEREGISTER_PAUSE_S = 0.3
# The grace of calls when a service fails: what waited on the failed part has ended.
FAILED_GRACE_S = 2.0
EXIT_FAILED = 3  # the service failed while serving; a supervisor should restart it


class ServiceFailed(RuntimeError):
    """The service cannot serve any more (``Serving.watch`` said why)."""


@dataclass
class Serving:
    """What a started service hands to ``run_service``."""

    server: grpc.aio.Server  # from grpc_utils.start_server: health and reflection included
    port: int  # the bound port
    publisher: RegistryPublisher | None = None  # started after the server, stopped first
    ready_lines: list[tuple[str, str]] = field(default_factory=list)  # more READY lines
    # Drained beside the gRPC server, given the same grace seconds (e.g. the REST server).
    drains: list[Callable[[float], Awaitable[None]]] = field(default_factory=list)
    # Returns (a reason) once the service can no longer serve: it then leaves and exits 3.
    watch: Callable[[], Awaitable[str]] | None = None
    draining: bool = False  # set as the drain begins (the metrics port's /health then 503)


StartFn = Callable[[Any, contextlib.AsyncExitStack], Awaitable[Serving]]


def run_service(
    name: str, cls: type[S], argv: Sequence[str] | None, description: str, start: StartFn
) -> int:
    """Run service ``name`` until SIGTERM or SIGINT; the process's exit code.

    ``start(settings, resources)`` builds the service; whatever it registers on
    ``resources`` (an AsyncExitStack) is released when the service stops or fails to start.
    """
    settings = parse_settings(cls, argv, prog=f"pdserve {name}", description=description)
    configure_logging(settings.log)
    warn_unknown_env(known_env())
    logger.info("%s settings: %s", name, settings)
    try:
        traced = getattr(settings, "tracing", None)
        if traced is not None:
            endpoint = tracing.endpoint_of(traced.otlp_traces_endpoint)
            tracing.configure(endpoint, traced.trace_sample_ratio, f"pdserve-{name}")
        asyncio.run(_serve(name, settings, start))
    except (ValueError, FileNotFoundError) as error:  # a bad setting or model directory
        print(f"pdserve {name}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # e.g. the port is taken
        print(f"pdserve {name}: error: {error}", file=sys.stderr)
        return 1
    except ServiceFailed as error:
        print(
            f"pdserve {name}: error: {error}; exiting {EXIT_FAILED} to be restarted",
            file=sys.stderr,
        )
        return EXIT_FAILED
    finally:
        tracing.shutdown()  # the last spans leave before the process does
    return 0


async def _serve(name: str, settings: Any, start: StartFn) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with contextlib.AsyncExitStack() as resources:
            serving = await start(settings, resources)
            if serving.publisher is not None:
                await serving.publisher.start()
            print(f"READY {name} {host_port(settings.server.host, serving.port)}", flush=True)
            for ready_name, address in serving.ready_lines:
                print(f"READY {ready_name} {address}", flush=True)
            failure = await _until_stopped(stop, serving.watch)
            if failure is not None:
                logger.critical(
                    "%s cannot serve any more: %s; leaving (deregister, NOT_SERVING, exit %d)",
                    name,
                    failure,
                    EXIT_FAILED,
                )
                await _drain(serving, min(FAILED_GRACE_S, settings.server.drain_timeout))
                raise ServiceFailed(failure)
            await _drain(serving, settings.server.drain_timeout)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    logger.info("%s stopped", name)


async def _until_stopped(
    stop: asyncio.Event, watch: Callable[[], Awaitable[str]] | None
) -> str | None:
    """Wait for a stop signal (None) or for ``watch`` to say why the service failed."""
    stopped = asyncio.ensure_future(stop.wait())
    waits = {stopped}
    if watch is not None:
        waits.add(asyncio.ensure_future(watch()))
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return None if stopped in done else done.pop().result()


async def _drain(serving: Serving, grace_s: float) -> None:
    logger.info("draining: running calls get %.0f s", grace_s)
    serving.draining = True
    if serving.publisher is not None:
        await serving.publisher.stop()
    await serving.server.health_servicer.enter_graceful_shutdown()
    if serving.publisher is not None:
        await asyncio.sleep(DEREGISTER_PAUSE_S)
    await asyncio.gather(serving.server.stop(grace=grace_s), *(d(grace_s) for d in serving.drains))
