"""An engine worker's life: load the engine onto its thread, serve it over gRPC, register it.

A worker started with ``--redis-url`` registers itself (address, role, model fingerprint,
block size, capacity, tensor-parallel size); its heartbeat publishes its load, read from
the engine's stats snapshot without waiting for a step, and the block hashes its prefix
cache stores and evicts. ``run_service`` does the rest (READY line, drain on SIGTERM), and
makes the worker leave when the engine's watchdog says it is dead (its thread died, or a
step ran past ``--engine-stall-timeout``): its requests end with UNAVAILABLE, it turns
NOT_SERVING, deregisters and exits 3, for its supervisor to start a fresh one. Its
Prometheus /metrics are served on ``--metrics-port``, whose address it registers and
prints in a ``READY <role>-metrics HOST:PORT`` line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable

import grpc

from pdserve.controlplane.publisher import RegistryPublisher, publisher_for
from pdserve.core.model import ModelConfig
from pdserve.core.sampling import SamplingParams
from pdserve.engine.async_engine import AsyncEngine, EngineDead
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestError
from pdserve.engine.prepare_model import resolve_model
from pdserve.engine.structured_output import GrammarCompiler, GrammarError
from pdserve.runtime.metrics import metrics_server_address, start_metrics
from pdserve.runtime.rpc import start_server
from pdserve.runtime.service import Serving
from pdserve.runtime.token_ring import TokenRing
from pdserve.runtime.trust import Trust
from pdserve.settings.process import host_port
from pdserve.settings.services import DecodeSettings, PrefillSettings
from pdserve.worker.faults import step_fault
from pdserve.worker.grammars import GrammarBusy, GrammarPreparer
from pdserve.worker.telemetry import WorkerMetrics

logger = logging.getLogger(__name__)


def error_status(request_id: str, error: RequestError | None) -> tuple[grpc.StatusCode, str]:
    """The status of a request the engine ended with ERROR: INVALID_ARGUMENT when its own
    values caused it, UNAVAILABLE when the engine itself is down (retry elsewhere), else
    INTERNAL; the message names the request."""
    if error is None:
        return grpc.StatusCode.INTERNAL, f"request {request_id}: the engine failed; see its log"
    if error.engine_down:
        return grpc.StatusCode.UNAVAILABLE, f"request {request_id}: {error.message}"
    code = grpc.StatusCode.INVALID_ARGUMENT if error.invalid else grpc.StatusCode.INTERNAL
    return code, f"request {request_id}: {error.message}"


def start_engine(
    settings: PrefillSettings | DecodeSettings, resources: contextlib.AsyncExitStack
) -> tuple[AsyncEngine, GrammarPreparer]:
    """Load ``settings.engine``'s model into an engine on its own thread, and the grammar
    compiler beside it (xgrammar and the vocabulary load on another thread meanwhile, so a
    serving worker's event loop never pauses for them); both stopped with ``resources``.
    ValueError / FileNotFoundError for a bad model or engine setting."""
    fault = step_fault()  # test-only; a bad value stops the start before the model loads
    path = resolve_model(settings.engine.model)
    args = dataclasses.replace(settings.engine, model=str(path))
    if isinstance(settings, PrefillSettings):  # a prefill step never speculates: no draft
        args = dataclasses.replace(args, speculative_config=None)
    config = ModelConfig.from_dir(path)
    compiler = GrammarCompiler(path, config.vocab_size, config.eos_token_ids)
    grammars = GrammarPreparer(compiler, settings.engine.grammar_compile_timeout)
    grammars.start_warming()
    resources.callback(grammars.close)
    engine = AsyncEngine(lambda: LLMEngine(args, str(path), grammars=compiler), before_step=fault)
    resources.callback(engine.shutdown)
    grammars.wait_warm()
    return engine, grammars


async def prepare_grammar(
    grammars: GrammarPreparer | None, params: SamplingParams, context: grpc.aio.ServicerContext
) -> None:
    """Compile the request's grammar before the engine takes it; abort the call with
    INVALID_ARGUMENT for a bad or too slow one, RESOURCE_EXHAUSTED when the compile
    thread is taken."""
    if grammars is None:
        return
    try:
        await grammars.prepare(params)
    except GrammarBusy as error:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
    except GrammarError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


def engine_publisher(
    settings: PrefillSettings | DecodeSettings,
    role: str,
    port: int,
    engine: AsyncEngine,
    worker_id: str | None = None,
    metrics_address: str = "",
    token: TokenRing | None = None,
    entry: dict | None = None,
) -> RegistryPublisher | None:
    """The worker's registry publisher, or None without ``--redis-url``; its entry is
    signed with ``token``, the internal token. ``entry``: more of the entry's fixed fields
    (its NIXL agent)."""
    info = engine.info

    async def load() -> dict:
        s = engine.stats
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_free_blocks": s.num_free_blocks,
            "num_cached_blocks": s.num_cached_blocks,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "requests_total": engine.num_requests,
            "spec_num_drafts": s.spec_num_drafts,
            "spec_num_draft_tokens": s.spec_num_draft_tokens,
            "spec_num_accepted_tokens": s.spec_num_accepted_tokens,
        }

    async def blocks(full: bool) -> tuple[list[bytes], list[bytes]]:
        try:
            return await engine.call(lambda e: e.drain_block_events(full))
        except EngineDead:  # the worker is leaving; its entry goes with it
            return [], []

    return publisher_for(
        settings.registry,
        role,
        settings.server.host,
        port,
        load,
        blocks,
        worker_id=worker_id,
        token=token,
        model=info.model_name,
        metrics_address=metrics_address,
        fingerprint=info.fingerprint.hex(),
        block_size=info.layout.block_size,
        num_total_blocks=info.num_total_blocks,
        max_num_seqs=info.max_num_seqs,
        tensor_parallel_size=settings.engine.tensor_parallel_size,
        **(entry or {}),
    )


async def serve_engine(
    settings: PrefillSettings | DecodeSettings,
    resources: contextlib.AsyncExitStack,
    role: str,
    engine: AsyncEngine,
    add_servicer: Callable[[grpc.aio.Server], None],
    service_name: str,
    trust: Trust,
    metrics: WorkerMetrics,
    worker_id: str,
    entry: dict | None = None,
) -> Serving:
    """Serve ``engine`` as ``role`` on the settings' port, under ``trust``, and its
    ``metrics`` on ``--metrics-port``; the Serving for run_service."""
    metrics_server = start_metrics(settings, metrics.registry, resources)
    server, port = await start_server(
        host_port(settings.server.host, settings.server.port),
        [add_servicer],
        [service_name],
        credentials=trust.server_credentials,
        token=trust.tokens,
    )
    logger.info("%s: %s", role, trust.describe())
    resources.push_async_callback(server.stop, None)
    stall_timeout_s = settings.watchdog.engine_stall_timeout
    metrics_address = metrics_server_address(settings, metrics_server)
    serving = Serving(
        server,
        port,
        engine_publisher(
            settings, role, port, engine, worker_id, metrics_address, trust.tokens, entry
        ),
        watch=lambda: engine.watch(stall_timeout_s),
    )
    if metrics_server is not None:
        metrics_server.health = lambda: not serving.draining
    if metrics_address:
        serving.ready_lines.append((f"{role}-metrics", metrics_address))
    return serving
