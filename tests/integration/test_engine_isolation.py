"""A fault injected into one request's sampling ends that request only: the engine's other
requests, batched with it step after step, stay token-exact against transformers (float32
greedy), and the faulty one's blocks are freed. Through AsyncEngine, as workers run it."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.sequence import Sequence
from pdserve.testing.reference import compare, hf_greedy

MAX_NEW = 12
PROMPTS = [[(11 * i + 5 * k) % 480 + 7 for k in range(9 + 7 * i)] for i in range(6)]
FAULTY = "faulty"


@pytest.fixture(scope="module")
def refs(tiny_llama_path):
    return hf_greedy(tiny_llama_path, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("fault_at", [0, 5])  # at the first token (prefill) and mid-decode
def test_a_fault_in_one_request_leaves_the_others_exact(tiny_llama_path, refs, fault_at):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_kv_blocks=128)

    def fault(seq: Sequence) -> None:
        if seq.request_id == FAULTY and seq.num_output_tokens >= fault_at:
            raise RuntimeError("injected sampling fault")

    llm.engine.runner.sampler.fault = fault
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)

    async def collect(request_id: str, prompt: list[int]):
        tokens, last = [], None
        async for delta in engine.generate(request_id, prompt, params):
            tokens.extend(delta.token_ids)
            last = delta
        return tokens, last

    async def run_all():
        faulty = collect(FAULTY, PROMPTS[0])
        healthy = [collect(f"ok-{i}", p) for i, p in enumerate(PROMPTS)]
        return await asyncio.wait_for(asyncio.gather(faulty, *healthy), 120)

    try:
        (bad_tokens, bad_last), *healthy = asyncio.run(run_all())
    finally:
        engine.shutdown()
    assert bad_last.finish_reason == "error"
    assert "injected sampling fault" in bad_last.error.message and not bad_last.error.invalid
    assert len(bad_tokens) == fault_at
    for (tokens, last), ref in zip(healthy, refs, strict=True):
        assert last.finish_reason == "length"
        assert compare(tokens, ref) is None
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
