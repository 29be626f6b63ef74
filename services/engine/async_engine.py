"""An LLMEngine on its own thread, driven from asyncio: the form the gRPC workers use.

All engine state is touched by the engine thread only. Coroutines send it commands
through a queue and receive each request's outputs on an asyncio.Queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from services.engine.engine import EngineStats, LLMEngine
from services.engine.kv_transfer import ExportedBlock
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    """New tokens of one request after an engine step; ``finish_reason`` on the last one."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_imported_tokens: int = 0
    exported: list[ExportedBlock] | None = None  # prefill mode: the prompt's blocks


class AsyncEngine:
    """Runs ``engine.step()`` in a loop on a thread while there is work."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int, bool]] = {}
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
        export_blocks: bool = False,
        imported: tuple[int, TokenLogprobs | None, dict[bytes, bytes]] | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Stream a request's outputs. ``export_blocks``: keep and return the prompt's KV
        blocks (prefill workers). ``imported``: (first token, its logprob, fetched blocks) of
        a request prefilled elsewhere. Leaving the iteration early aborts the request."""
        self.engine.validate_prompt(prompt_token_ids)
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        error: list[BaseException] = []

        def add() -> None:
            try:
                if imported is None:
                    seq = self.engine.add_request(prompt_token_ids, params, request_id)
                    seq.hold_blocks = export_blocks
                else:
                    first, first_lp, fetched = imported
                    seq = self.engine.add_imported_request(
                        prompt_token_ids, params, request_id, first, first_lp, fetched
                    )
                self._streams[request_id] = (loop, out, 0, export_blocks)
                if imported is not None:
                    self._emit(seq)  # the first token came from the prefill worker
            except BaseException as e:  # noqa: BLE001 (handed to the caller)
                error.append(e)
                loop.call_soon_threadsafe(out.put_nowait, None)

        self._commands.put(add)
        finished = False
        try:
            while True:
                item = await out.get()
                if item is None:
                    raise error[0]
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(lambda: self._abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run ``fn(engine)`` on the engine thread and return its result."""
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
            except BaseException as e:  # noqa: BLE001
                loop.call_soon_threadsafe(settle, None, e)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        self._commands.put(run)
        return await fut

    async def stats(self) -> EngineStats:
        return await self.call(lambda e: e.stats())

    def shutdown(self) -> None:
        self._stop = True
        self._commands.put(lambda: None)
        self._thread.join(timeout=10)

    # --- engine thread -------------------------------------------------------------

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)
        self.engine.release_held(request_id)

    def _emit(self, seq: Sequence) -> None:
        entry = self._streams.get(seq.request_id)
        if entry is None:
            return
        loop, out, sent, export = entry
        tokens = seq.output_token_ids[sent:]
        logprobs = seq.logprobs[sent:] if seq.logprobs is not None else []
        exported = None
        if seq.is_finished:
            self._streams.pop(seq.request_id, None)
            if export:
                exported = self.engine.export_prompt_blocks(seq.request_id)
        else:
            self._streams[seq.request_id] = (loop, out, seq.num_output_tokens, export)
        item = StepOutput(
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=seq.finish_reason if seq.is_finished else None,
            num_cached_tokens=seq.num_cached_tokens,
            num_imported_tokens=seq.num_imported_tokens,
            exported=exported,
        )
        loop.call_soon_threadsafe(out.put_nowait, item)

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
            if self._stop or not self.engine.has_unfinished():
                continue
            try:
                advanced, _ = self.engine.step()
            except Exception:  # a bug: fail every open request rather than hang them
                logger.exception("engine step failed")
                for rid in list(self._streams):
                    loop, out, _, _ = self._streams.pop(rid)
                    loop.call_soon_threadsafe(
                        out.put_nowait,
                        StepOutput([], [], finish_reason="error"),
                    )
                    self.engine.abort(rid)
                continue
            for seq in advanced:
                self._emit(seq)
