"""An LLMEngine on its own thread, driven from asyncio: the form the gRPC workers use.

All engine state is touched by the engine thread only. Coroutines send it commands
through a queue and receive each request's outputs on an asyncio.Queue; what other
threads may read is fixed at start (``info``) or a snapshot the engine thread replaces
after every step (``stats``), so a heartbeat never waits behind a long step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from services.common.kv_blocks import FetchedBlocks
from services.common.sampling import SamplingParams, TokenLogprobs
from services.engine.engine import LLMEngine
from services.engine.outputs import RequestDelta, RequestError
from services.engine.sequence import PREFILLED, Sequence

logger = logging.getLogger(__name__)


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
    """Runs ``engine.step()`` in a loop on a thread while there is work."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.info = engine.info()
        self.stats = engine.stats()
        self.num_requests = 0  # requests taken, for the registry
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

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
        try:
            if handover is None:
                await self.call(
                    lambda e: self._open(
                        e.add_request(
                            prompt_token_ids, params, request_id, prefill_only=prefill_only
                        ),
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
                await self.call(
                    lambda e: self._open(
                        e.finish_import(request_id, fetched.found, len(fetched.rejected)),
                        loop,
                        out,
                        sent=1 + len(handover.resumed),
                    )
                )
            while True:
                delta = await out.get()
                yield delta
                if delta.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(lambda: self._abort(request_id))

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

        self._commands.put(run)
        return await fut

    def shutdown(self) -> None:
        self._stop = True
        self._commands.put(lambda: None)
        self._thread.join(timeout=10)

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
            if reason == PREFILLED:
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
            error=seq.error if reason == "error" else None,
        )
        loop.call_soon_threadsafe(out.put_nowait, delta)

    def _run(self) -> None:
        while not self._stop:
            block = not self.engine.has_unfinished()
            try:
                while True:
                    cmd = self._commands.get(block=block, timeout=1.0 if block else None)
                    cmd()
                    block = False
            except queue.Empty:
                pass
            self.stats = self.engine.stats()
            if self._stop or not self.engine.has_unfinished():
                continue
            try:
                step = self.engine.step()
            except Exception as error:  # a bug: fail every open request rather than hang them
                logger.exception("engine step failed")
                self._fail_all(RequestError(f"the engine step failed: {error!r}"))
                continue
            for seq in step.advanced:
                self._emit(seq)

    def _fail_all(self, error: RequestError) -> None:
        for request_id in list(self._streams):
            loop, out, _ = self._streams.pop(request_id)
            delta = RequestDelta([], [], finish_reason="error", error=error)
            loop.call_soon_threadsafe(out.put_nowait, delta)
            self.engine.abort(request_id)
