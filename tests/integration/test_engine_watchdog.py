"""AsyncEngine's watchdog in-process, on the tiny Llama: a dead or stalled engine thread
ends every request and call waiting on it, refuses new ones, and ``watch`` says why."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.async_engine import AsyncEngine, EngineDead

PARAMS = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
PROMPT = list(range(5, 30))


async def _collect(engine: AsyncEngine, request_id: str):
    tokens, last = [], None
    async for delta in engine.generate(request_id, PROMPT, PARAMS):
        tokens.extend(delta.token_ids)
        last = delta
    return tokens, last


def _engine(tiny_llama_path, before_step) -> AsyncEngine:
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_kv_blocks=64, enforce_eager=True)
    return AsyncEngine(llm.engine, before_step=before_step)


def test_a_dead_engine_thread_ends_every_request_and_refuses_new_ones(tiny_llama_path):
    def before_step(step: int) -> None:
        if step == 4:
            raise RuntimeError("injected death")

    engine = _engine(tiny_llama_path, before_step)

    async def run():
        watch = asyncio.create_task(engine.watch(stall_timeout_s=60))
        results = await asyncio.wait_for(
            asyncio.gather(_collect(engine, "a"), _collect(engine, "b")), 60
        )
        reason = await asyncio.wait_for(watch, 10)
        late = await asyncio.wait_for(_collect(engine, "late"), 10)
        with pytest.raises(EngineDead, match="injected death"):
            await asyncio.wait_for(engine.call(lambda e: e.stats()), 10)
        return results, reason, late

    try:
        results, reason, late = asyncio.run(run())
    finally:
        engine.shutdown()
    assert "the engine thread died" in reason and "injected death" in reason
    for _, last in [*results, late]:
        assert last.finish_reason == "error" and last.error.engine_down
        assert "retry on another worker" in last.error.message
    assert all(0 < len(tokens) < 64 for tokens, _ in results)
    assert late[0] == []


def test_a_stalled_step_is_declared_dead_and_a_slow_one_is_not(tiny_llama_path):
    release = threading.Event()
    slow_steps = {0, 1, 2}

    def before_step(step: int) -> None:
        if step in slow_steps:
            release.wait(0.3)  # slow: under the timeout
        elif step == 6:
            release.wait()  # stalled until the test lets it go

    engine = _engine(tiny_llama_path, before_step)

    async def run():
        watch = asyncio.create_task(engine.watch(stall_timeout_s=1.5))
        tokens, last = await asyncio.wait_for(_collect(engine, "a"), 60)
        reason = await asyncio.wait_for(watch, 10)
        return tokens, last, reason

    try:
        tokens, last, reason = asyncio.run(run())
    finally:
        release.set()
        engine.shutdown()
    assert len(tokens) == 6  # the slow steps went on; the 7th never returned
    assert last.finish_reason == "error" and last.error.engine_down
    assert "stuck in one step" in reason and "--engine-stall-timeout 1.5" in reason
