"""An LLMEngine on its own thread, driven from asyncio: the form the gRPC workers use.

All engine state is touched by the engine thread only. Coroutines send it commands
through a queue and receive each request's outputs on an asyncio.Queue; what other
threads may read is fixed at start (``info``) or a snapshot the engine thread replaces
after every step (``stats``), so a heartbeat never waits behind a long step.

An engine whose thread dies (an exception outside a step's error handling) or stops
returning from a step or command (``watch``'s stall timeout) is dead for good: every
request and call waiting on it ends at once (an ``engine_down`` error, ``EngineDead``),
new ones are refused, and ``watch`` tells the worker, which then leaves.

An engine built by the engine thread itself (``AsyncEngine(make_engine)``, as the workers
do) is the only user of OpenMP threads in the process: the thread that starts it runs its
own torch ops serially from then on. libgomp keeps a pool of worker threads for every
thread that has ever opened a parallel region, and once the process holds more of them
than it has cores it stops spinning between regions and sleeps on a futex instead; a
compiled CPU step opens a few hundred regions, and paid a wake-up for each (a SmolLM2
decode step on 2 cores: 13 ms on the thread that had built the engine, 40 ms on another).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import torch

from pdserve.core.finish_reason import FinishReason
from pdserve.core.sampling import SamplingParams, TokenLogprobs
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestDelta, RequestError, StepOutput
from pdserve.engine.sequence import Sequence
from pdserve.kv.blocks import FetchedBlocks

logger = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """The engine thread died or stalled: nothing sent to this engine will finish."""


@dataclass(frozen=True)
class Handover:
    """A request prefilled elsewhere: its first token, and how to get its prompt's blocks.

    ``fetch(num_local)`` returns the blocks (by key) after the first ``num_local``, which
    this engine's own prefix cache holds; a block it does not return as found is recomputed.
    ``resumed``: tokens after the first that the client has already (a migrated stream).
    """

    first_token: int
    first_logprob: TokenLogprobs | None
    fetch: Callable[[int], Awaitable[FetchedBlocks]]
    resumed: tuple[int, ...] = ()


class AsyncEngine:
    """Runs ``engine.step()`` in a loop on a thread while there is work.

    ``before_step(num_steps)`` runs on the engine thread before each step, outside the
    step's error handling (the worker's test-only fault injection).
    """

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        before_step: Callable[[int], None] | None = None,
    ) -> None:
        """``engine``: an engine, or a function that builds one, which the engine thread
        then calls (its error, e.g. a bad model, is raised here)."""
        make = None if isinstance(engine, LLMEngine) else engine
        self.num_requests = 0  # requests taken, for the registry
        self.num_steps = 0
        self.failure: str | None = None  # why the engine is dead; set once, never cleared
        self._before_step = before_step
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self._stop = False
        # When the step or command the engine thread runs now began (monotonic); None idle.
        self._busy_since: float | None = None
        # Whom to tell when the engine dies: callables safe to call from any thread.
        self._lock = threading.Lock()
        self._waiters: dict[int, Callable[[EngineDead], None]] = {}
        self._waiter_ids = itertools.count()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        threads = 0
        if make is None:
            self.engine = engine
        else:
            threads = _serial_from_now()
        self._thread = threading.Thread(
            target=self._run, args=(make, threads), name="engine", daemon=True
        )
        self._thread.start()
        if make is not None:
            while not self._built.wait(1.0):  # a load has no deadline; a dead thread ends it
                if not self._thread.is_alive():
                    break
            if not self._built.is_set() or self._build_error is not None:
                self._thread.join(timeout=10)
                raise self._build_error or RuntimeError("the engine thread ended while loading")
        self.info = self.engine.info()
        self.stats = self.engine.stats()

    # --- called from asyncio -------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        handover: Handover | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Stream a request's new tokens; the last delta has its finish reason.

        ``prefill_only``: stop after the first token; a PREFILLED finish carries the
        prompt's exported blocks. ``handover``: a request prefilled elsewhere, whose first
        token the client already has: the stream starts after it. Raises ValueError for a
        request the engine refuses; leaving the iteration early aborts the request.
        """
        self.num_requests += 1
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[RequestDelta] = asyncio.Queue()
        finished = False
        waiter = self._on_death(lambda e: _post(loop, out.put_nowait, _engine_down(e)))
        try:
            try:
                await self._open_request(
                    request_id, prompt_token_ids, params, prefill_only, handover, loop, out
                )
            except EngineDead as error:
                finished = True
                yield _engine_down(error)
                return
            while True:
                delta = await out.get()
                yield delta
                if delta.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._forget(waiter)
            if not finished and self.failure is None:
                self._commands.put(lambda: self._abort(request_id))

    async def _open_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool,
        handover: Handover | None,
        loop: asyncio.AbstractEventLoop,
        out: asyncio.Queue,
    ) -> None:
        """Add the request to the engine, its outputs streamed to ``out``."""
        if handover is None:
            await self.call(
                lambda e: self._open(
                    e.add_request(prompt_token_ids, params, request_id, prefill_only=prefill_only),
                    loop,
                    out,
                    sent=0,
                )
            )
        else:
            num_local = await self.call(
                lambda e: e.begin_import(
                    prompt_token_ids,
                    params,
                    request_id,
                    handover.first_token,
                    handover.first_logprob,
                    handover.resumed,
                )
            )
            fetched = await handover.fetch(num_local)

            def finish(e: LLMEngine) -> None:
                try:
                    seq = e.finish_import(request_id, fetched.found, len(fetched.rejected))
                finally:
                    fetched.done()  # on this thread: the import has copied the bytes
                self._open(seq, loop, out, sent=1 + len(handover.resumed))

            await self.call(finish)

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run ``fn(engine)`` on the engine thread and return its result (or raise its error)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(result: object, error: BaseException | None) -> None:
            if fut.done():  # the caller stopped waiting (cancelled, or timed out)
                return
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 (handed to the caller)
                loop.call_soon_threadsafe(settle, None, e)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        waiter = self._on_death(lambda e: _post(loop, settle, None, e))
        try:
            self._commands.put(run)
            return await fut
        finally:
            self._forget(waiter)

    async def watch(self, stall_timeout_s: float) -> str:
        """Return why the engine failed, once it has: its thread died, or one step or
        command has run for over ``stall_timeout_s`` seconds (the thread is abandoned).
        Every request and call waiting on it has ended by then."""
        loop = asyncio.get_running_loop()
        failed: asyncio.Future[str] = loop.create_future()
        waiter = self._on_death(lambda e: _post(loop, _settle_once, failed, str(e)))
        poll_s = min(0.5, stall_timeout_s / 4)
        try:
            while not failed.done():
                await asyncio.wait({failed}, timeout=poll_s)
                busy_s = self.busy_for()
                if busy_s > stall_timeout_s:
                    self._die(
                        f"the engine thread has been stuck in one step or command for {busy_s:.0f} s "
                        f"(--engine-stall-timeout {stall_timeout_s:g})"
                    )
                elif not self._thread.is_alive() and not self._stop:
                    self._die("the engine thread ended")
                elif (lost := self.engine.lost_rank()) is not None:
                    self._die(lost)  # a tensor-parallel rank died between steps
            return failed.result()
        finally:
            self._forget(waiter)

    def busy_for(self) -> float:
        """Seconds the engine thread has spent in its current step or command (0 idle)."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def shutdown(self) -> None:
        self._stop = True
        self._commands.put(lambda: None)
        if self.failure is None:  # a dead or stuck thread is not waited for
            self._thread.join(timeout=10)
        # A tensor-parallel engine's other ranks: told to stop, or killed where the engine
        # thread died or is stuck.
        self.engine.close(graceful=self.failure is None and not self._thread.is_alive())

    # --- any thread ----------------------------------------------------------------

    def _on_death(self, notify: Callable[[EngineDead], None]) -> int:
        """Call ``notify(EngineDead)`` when the engine dies (now, if it has); a key for
        ``_forget``."""
        with self._lock:
            key = next(self._waiter_ids)
            if self.failure is None:
                self._waiters[key] = notify
                return key
        notify(EngineDead(self.failure))
        return key

    def _forget(self, key: int) -> None:
        with self._lock:
            self._waiters.pop(key, None)

    def _die(self, reason: str) -> None:
        """Mark the engine dead, once, and end everything waiting on it."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            self._stop = True  # a stuck thread that wakes up leaves its loop
            waiters, self._waiters = list(self._waiters.values()), {}
        logger.critical("engine failed: %s", reason)
        error = EngineDead(reason)
        for notify in waiters:
            notify(error)

    # --- engine thread -------------------------------------------------------------

    def _open(self, seq: Sequence, loop: asyncio.AbstractEventLoop, out: asyncio.Queue, sent: int):
        """Stream ``seq``'s tokens after the first ``sent`` to ``out``."""
        self._streams[seq.request_id] = (loop, out, sent)
        if seq.is_finished:  # done on arrival (an imported first token ended it)
            self._emit(seq)

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    def _emit(self, seq: Sequence) -> None:
        entry = self._streams.get(seq.request_id)
        if entry is None:
            return
        loop, out, sent = entry
        reason, exported = None, None
        if seq.is_finished:
            del self._streams[seq.request_id]
            reason = seq.finish_reason
            if reason is FinishReason.PREFILLED:
                exported = self.engine.export_prompt_blocks(seq.request_id)
        else:
            self._streams[seq.request_id] = (loop, out, seq.num_output_tokens)
        delta = RequestDelta(
            token_ids=seq.output_token_ids[sent:],
            logprobs=seq.logprobs[sent:] if seq.logprobs is not None else [],
            finish_reason=reason,
            num_cached_tokens=seq.num_cached_tokens,
            num_imported_tokens=seq.num_imported_tokens,
            exported=exported,
            error=seq.error if reason is FinishReason.ERROR else None,
            times=seq.times if reason is not None else None,
            num_preemptions=seq.num_preemptions,
            spec=seq.spec_pending,
            prompt_logprobs=seq.prompt_logprobs if sent == 0 else None,
        )
        seq.spec_pending = None
        _post(loop, out.put_nowait, delta)

    def _run(self, make: Callable[[], LLMEngine] | None, threads: int) -> None:
        if make is not None:
            try:
                torch.set_num_threads(threads)
                self.engine = make()
            except BaseException as error:  # noqa: BLE001 (raised by the constructor)
                self._build_error = error
                return
            finally:
                self._built.set()
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 (the engine is dead: say so, then leave)
            logger.critical("the engine thread died", exc_info=True)
            self._die(f"the engine thread died: {error!r}")

    def _loop(self) -> None:
        while not self._stop:
            block = not self.engine.has_unfinished()
            try:
                while True:
                    cmd = self._commands.get(block=block, timeout=1.0 if block else None)
                    self._busy_since = time.monotonic()
                    cmd()
                    self._busy_since = None
                    block = False
            except queue.Empty:
                pass
            self.stats = self.engine.stats()
            if self._stop or not self.engine.has_unfinished():
                continue
            self._busy_since = time.monotonic()
            if self._before_step is not None:
                self._before_step(self.num_steps)
            step = self._step()
            self.num_steps += 1
            self._busy_since = None
            if self.failure is not None:  # declared stalled meanwhile: its requests have ended
                return
            # Before the outputs go out: whoever has a request's last token sees its counts.
            self.stats = self.engine.stats()
            for seq in step.advanced if step is not None else ():
                self._emit(seq)

    def _step(self) -> StepOutput | None:
        """One engine step; None when it raised (every open request then ends with an error)."""
        try:
            return self.engine.step()
        except Exception as error:  # a bug: fail every open request rather than hang them
            logger.exception("engine step failed")
            self._fail_all(RequestError(f"the engine step failed: {error!r}"))
            return None

    def _fail_all(self, error: RequestError) -> None:
        for request_id in list(self._streams):
            loop, out, _ = self._streams.pop(request_id)
            delta = RequestDelta([], [], finish_reason=FinishReason.ERROR, error=error)
            _post(loop, out.put_nowait, delta)
            self.engine.abort(request_id)


def _engine_down(error: EngineDead) -> RequestDelta:
    """The last delta of a request whose engine died under it."""
    message = f"the worker's engine failed ({error}); retry on another worker"
    return RequestDelta(
        [], [], finish_reason=FinishReason.ERROR, error=RequestError(message, engine_down=True)
    )


# torch's thread count before the first _serial_from_now(): what every engine thread takes.
_engine_threads: int | None = None


def _serial_from_now() -> int:
    """Run the calling thread's torch ops on it alone, for good; return torch's thread count
    before, for the engine thread to take.

    ``torch.set_num_threads`` sets the count of the thread that calls it and the default of
    threads that have not yet run a parallel op: the small op settles this thread's count at
    1 before the engine thread sets the default back.
    """
    global _engine_threads
    if _engine_threads is None:  # a thread made serial before reads 1 here, not the count
        _engine_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.zeros(2).add_(1)
    return _engine_threads


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, *args: object) -> None:
    """``fn(*args)`` on ``loop``, from any thread; nothing when the loop has closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _settle_once(fut: asyncio.Future, result: object) -> None:
    if not fut.done():
        fut.set_result(result)
