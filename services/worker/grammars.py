"""A worker compiles each request's structured output before the engine sees it: on a thread
of its own, within ``--grammar-compile-timeout``, so that a slow grammar never stalls the
engine thread's steps, and a bad one is refused with the compiler's reason.

Compilation cannot be interrupted once it runs: a grammar past its deadline is refused, and
its compile runs on to the end on the one compile thread (its result cached). Requests
behind it wait their own deadlines and are refused as busy (RESOURCE_EXHAUSTED, retry
later) if they expire before their compile starts; a compile that never started is
dropped. So one pathological grammar costs one core for its compile time, and never more.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

from pdserve.core.sampling import SamplingParams, StructuredOutputs
from pdserve.engine.structured_output import GrammarCompiler, GrammarError

logger = logging.getLogger(__name__)

# How long a request waits for xgrammar to load (once per worker, a few seconds).
WARM_TIMEOUT_S = 120.0


class GrammarBusy(RuntimeError):
    """The compile thread is taken by other grammars past this request's deadline."""


class GrammarPreparer:
    """Compiles requests' grammars ahead of the engine, each within ``timeout_s``."""

    def __init__(self, compiler: GrammarCompiler, timeout_s: float) -> None:
        self.compiler = compiler
        self.timeout_s = timeout_s
        self._compile_thread = concurrent.futures.ThreadPoolExecutor(1, "grammar-compile")
        self._warm_thread = concurrent.futures.ThreadPoolExecutor(1, "grammar-warm")
        self._warm: concurrent.futures.Future | None = None
        self._pending: dict[bytes, tuple[concurrent.futures.Future, list[float]]] = {}

    def start_warming(self) -> None:
        """Load xgrammar and the vocabulary on a thread of their own (a worker starts this
        while its model loads: the load holds the GIL for a second or more, which would
        stall the event loop of a serving worker)."""
        if self._warm is None:
            self._warm = self._warm_thread.submit(self.compiler.warm)

    def wait_warm(self) -> None:
        """Wait for ``start_warming``'s load; log (not raise) its failure: requests with a
        grammar then fail with its error, the others are served."""
        self.start_warming()
        try:
            self._warm.result(timeout=WARM_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 (logged; the requests that need it fail)
            logger.error("structured outputs unavailable: %s", error)

    def close(self) -> None:
        self._compile_thread.shutdown(wait=False, cancel_futures=True)
        self._warm_thread.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, params: SamplingParams) -> None:
        """Compile ``params``' grammar (if it has one not compiled yet). Raises GrammarError
        (the request's fault: a bad grammar, or one past the deadline) or GrammarBusy."""
        spec = params.structured_outputs
        if spec is None or self.compiler.is_cached(spec):
            return
        self.start_warming()
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._warm)), WARM_TIMEOUT_S)
        except TimeoutError:
            raise GrammarBusy(
                f"the grammar engine did not load within {WARM_TIMEOUT_S:g} s; retry"
            ) from None
        future, started = self._submit(spec)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except TimeoutError:
            if future.cancel():  # never started: another grammar took the thread
                raise GrammarBusy(
                    f"this worker spent the {self.timeout_s:g} s this request could wait "
                    "(--grammar-compile-timeout) compiling other requests' grammars; retry"
                ) from None
            ran = time.monotonic() - started[0] if started else self.timeout_s
            raise GrammarError(
                f"compiling the request's structured output took more than {ran:.1f} s "
                f"(--grammar-compile-timeout {self.timeout_s:g}); simplify the schema, regex "
                "or grammar"
            ) from None

    def _submit(self, spec: StructuredOutputs) -> tuple[concurrent.futures.Future, list[float]]:
        """The compile of ``spec``: one already queued or running, or a new one."""
        key = spec.key()
        if key in self._pending:
            return self._pending[key]
        started: list[float] = []

        def compile_it() -> None:
            started.append(time.monotonic())
            began = time.perf_counter()
            self.compiler.compile(spec)
            logger.info(
                "compiled a %s constraint in %.1f ms",
                spec.kind,
                (time.perf_counter() - began) * 1e3,
            )

        future = self._compile_thread.submit(compile_it)
        self._pending[key] = (future, started)
        future.add_done_callback(lambda _: self._pending.pop(key, None))
        return future, started
