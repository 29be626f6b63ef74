"""The engine's seams for disaggregation, on a tiny model: a prefill-only request stops at its
first token with the one stop check; a handed-over request holds its cached prefix, fetches
only the rest, streams only the tokens after the first, and an abort at any point frees all."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.core.finish_reason import FinishReason
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.async_engine import AsyncEngine, Handover
from pdserve.kv.blocks import FetchedBlocks

PROMPT = list(range(40, 90))  # 3 full blocks and a tail of 2


@pytest.fixture(scope="module")
def llms(tiny_llama_path):
    make = lambda: LLM(model=str(tiny_llama_path), dtype="float32", num_kv_blocks=64)  # noqa: E731
    return make(), make()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def run(llm: LLM) -> None:
    """Step the engine until every request is done."""
    while llm.engine.has_unfinished():
        llm.engine.step()


@pytest.mark.parametrize(
    ("params", "reason"),
    [(greedy(8), FinishReason.PREFILLED), (greedy(1), FinishReason.LENGTH)],
)
def test_prefill_only_stops_at_the_first_token_with_the_one_stop_check(llms, params, reason):
    prefill, _ = llms
    seq = prefill.engine.add_request(PROMPT, params, f"p-{reason}", prefill_only=True)
    run(prefill)
    assert seq.num_output_tokens == 1 and seq.finish_reason == reason
    if reason is FinishReason.PREFILLED:
        blocks = prefill.engine.export_prompt_blocks(seq.request_id)
        assert [b.num_tokens for b in blocks] == [16, 16, 16, 2]
    assert prefill.stats().num_free_blocks == prefill.stats().num_total_blocks


def test_the_first_token_ending_the_request_is_a_stop_on_the_prefill_worker(llms):
    prefill, _ = llms
    (want,) = prefill.generate([PROMPT], greedy(1))
    params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(want.token_ids[0],))
    seq = prefill.engine.add_request(PROMPT, params, "p-stop", prefill_only=True)
    run(prefill)
    assert seq.finish_reason == "stop"
    assert prefill.stats().num_free_blocks == prefill.stats().num_total_blocks


async def test_a_handover_fetches_past_the_local_prefix_and_streams_after_the_first_token(llms):
    prefill, decode = llms
    (want,) = prefill.generate([PROMPT], greedy(10))
    prefill.engine.add_request(PROMPT, greedy(10), "h-1", prefill_only=True)
    run(prefill)
    exported = {b.key: b.data for b in prefill.engine.export_prompt_blocks("h-1")}
    keys = list(exported)
    decode.generate([PROMPT[:32] + [7]], greedy(1))  # its own cache: the first 2 blocks
    engine = AsyncEngine(decode.engine)
    asked = []

    async def fetch(num_local: int) -> FetchedBlocks:
        asked.append(num_local)
        return FetchedBlocks({k: exported[k] for k in keys[num_local:]})

    try:
        handover = Handover(want.token_ids[0], None, fetch)
        deltas = [d async for d in engine.generate("h-1", PROMPT, greedy(10), handover=handover)]
        stats = await engine.call(lambda e: e.stats())
    finally:
        engine.shutdown()
    assert asked == [2]
    assert [t for d in deltas for t in d.token_ids] == want.token_ids[1:]
    assert deltas[-1].finish_reason == "length"
    assert deltas[0].num_cached_tokens == 32 and deltas[0].num_imported_tokens == 18
    assert stats.num_free_blocks == stats.num_total_blocks


async def test_an_abort_while_fetching_frees_the_held_prefix(llms):
    _, decode = llms
    decode.generate([PROMPT[:48] + [7]], greedy(1))  # 3 cached blocks to hold
    engine = AsyncEngine(decode.engine)
    fetching = asyncio.Event()

    async def fetch(num_local: int) -> FetchedBlocks:
        fetching.set()
        await asyncio.sleep(60)
        return FetchedBlocks()

    async def consume() -> None:
        handover = Handover(1, None, fetch)
        async for _ in engine.generate("h-2", PROMPT, greedy(5), handover=handover):
            pass

    try:
        task = asyncio.create_task(consume())
        await asyncio.wait_for(fetching.wait(), 10)
        held = await engine.call(lambda e: e.stats())
        assert held.num_free_blocks == held.num_total_blocks - 3
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = await engine.call(lambda e: (e.stats(), e.pool.check_integrity()))
    finally:
        engine.shutdown()
    assert after[0].num_free_blocks == after[0].num_total_blocks


# -- a migrated stream: resumed after tokens generated elsewhere ---------------------------


@pytest.mark.parametrize("k", [1, 5, 19])
def test_a_resumed_request_continues_exactly(tiny_llama_path, llms, k):
    """Greedy: the tokens after the first k are transformers' (float32)."""
    from pdserve.testing.reference import compare, hf_greedy

    (ref,) = hf_greedy(tiny_llama_path, [PROMPT], 24)
    _, decode = llms
    eng = decode.engine
    eng.begin_import(PROMPT, greedy(24), f"resume-{k}", ref.tokens[0], None, tuple(ref.tokens[1:k]))
    seq = eng.finish_import(f"resume-{k}", {})
    run(decode)
    assert seq.num_output_tokens == 24 and seq.finish_reason == "length"
    assert compare(seq.output_token_ids, ref) is None
    assert decode.stats().num_free_blocks == decode.stats().num_total_blocks


def test_a_resumed_seeded_request_draws_what_the_unbroken_one_did(llms):
    """Seeded sampling with penalties: the draw of token i is keyed by i, and the resumed
    tokens count as output for the penalties."""
    prefill, decode = llms
    params = SamplingParams(
        max_tokens=20, temperature=0.9, seed=7, ignore_eos=True, presence_penalty=0.5
    )
    (whole,) = prefill.generate([PROMPT], params)
    eng = decode.engine
    tokens = whole.token_ids
    eng.begin_import(PROMPT, params, "resume-seeded", tokens[0], None, tuple(tokens[1:8]))
    seq = eng.finish_import("resume-seeded", {})
    run(decode)
    assert seq.output_token_ids == tokens
