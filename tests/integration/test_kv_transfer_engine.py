"""Prefill on one engine, export the prompt's blocks, import them into another, decode there:
the same tokens as one engine doing both, whatever blocks are missing on the way."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def engines(tiny_qwen2_path):
    make = lambda: LLM(model=str(tiny_qwen2_path), dtype="float32", num_kv_blocks=256)  # noqa: E731
    return make(), make(), make()


def _prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 15, 16, 17, 40, 130)]


def _prefill(llm: LLM, prompt, request_id):
    eng = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seq = eng.add_request(prompt, params, request_id, prefill_only=True)
    while eng.has_unfinished():
        eng.step()
    return seq.output_token_ids[0], eng.export_prompt_blocks(request_id)


def _decode(llm: LLM, prompt, request_id, first, fetched, max_tokens):
    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seq = eng.add_imported_request(prompt, params, request_id, first, None, fetched)
    while eng.has_unfinished():
        eng.step()
    return seq


@pytest.mark.parametrize("drop", ["none", "tail", "middle", "all"])
def test_transfer_gives_the_same_tokens(engines, drop):
    colocated, prefill, decode = engines
    for k, prompt in enumerate(_prompts()):
        (want,) = colocated.generate(
            [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        )
        rid = f"{drop}-{k}"
        first, blocks = _prefill(prefill, prompt, rid)
        assert first == want.token_ids[0]
        assert sum(b.num_tokens for b in blocks) == len(prompt)
        fetched = {b.key: b.data for b in blocks}
        if drop == "tail" and blocks:
            fetched.pop(blocks[-1].key)
        elif drop == "middle" and len(blocks) > 2:
            fetched.pop(blocks[len(blocks) // 2].key)
        elif drop == "all":
            fetched = {}
        decode.engine.pool.reset_prefix_cache()  # no help from earlier requests
        queries = decode.stats().prefix_cache_queries
        seq = _decode(decode, prompt, rid, first, fetched, 12)
        # One lookup per request, whether the import or the scheduler made it.
        assert decode.stats().prefix_cache_queries - queries in (len(prompt), len(prompt) + 1)
        assert seq.output_token_ids == want.token_ids, (drop, k)
        if drop == "none":
            assert seq.num_imported_tokens == len(prompt)
    for llm in engines:
        llm.check_integrity()
        assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def test_second_import_uses_the_decode_engines_own_cache(engines):
    _, prefill, decode = engines
    prompt = list(range(50, 120))  # 4 full blocks + a tail
    first, blocks = _prefill(prefill, prompt, "own-1")
    fetched = {b.key: b.data for b in blocks}
    seq1 = _decode(decode, prompt, "own-1", first, fetched, 3)
    assert seq1.num_imported_tokens == len(prompt)
    before = decode.stats()
    seq2 = _decode(decode, prompt, "own-2", first, fetched, 3)
    assert seq2.num_cached_tokens == 64  # the 4 full blocks, from its own prefix cache
    after = decode.stats()
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(prompt)
    assert after.prefix_cache_hits - before.prefix_cache_hits == 64
    assert seq2.output_token_ids == seq1.output_token_ids


def test_layouts_compare_field_by_field(engines, tiny_llama_path):
    colocated, _, _ = engines
    other = LLM(model=str(tiny_llama_path), dtype="float32", num_kv_blocks=128, block_size=8)
    ours = colocated.engine.block_layout()
    msg = "; ".join(ours.differences(other.engine.block_layout(), "ours", "theirs"))
    assert "block_size: ours 16, theirs 8" in msg
    assert "model_fingerprint" in msg
    assert ours.differences(colocated.engine.block_layout(), "ours", "theirs") == []


def test_seeded_sampling_continues_identically_across_the_split(engines):
    colocated, prefill, decode = engines
    prompt = list(range(30, 75))
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=77, ignore_eos=True)
    (want,) = colocated.generate([prompt], params)
    eng = prefill.engine
    seq = eng.add_request(prompt, params, "seeded", prefill_only=True)
    while eng.has_unfinished():
        eng.step()
    blocks = eng.export_prompt_blocks("seeded")
    out = decode.engine.add_imported_request(
        prompt, params, "seeded", seq.output_token_ids[0], None, {b.key: b.data for b in blocks}
    )
    while decode.engine.has_unfinished():
        decode.engine.step()
    assert out.output_token_ids == want.token_ids
    assert len(set(want.token_ids)) > 5  # really sampled


def test_a_block_of_the_wrong_length_is_recomputed_and_counted(engines):
    colocated, prefill, decode = engines
    prompt = list(range(200, 250))  # 3 full blocks and a tail of 2
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (want,) = colocated.generate([prompt], params)
    first, blocks = _prefill(prefill, prompt, "short-1")
    fetched = {b.key: bytes(b.data) for b in blocks}
    fetched[blocks[1].key] = fetched[blocks[1].key][:-4]
    decode.engine.pool.reset_prefix_cache()
    before = decode.stats()
    seq = _decode(decode, prompt, "short-1", first, fetched, 12)
    after = decode.stats()
    assert seq.output_token_ids == want.token_ids
    assert seq.num_imported_tokens == 16  # the block before it; the rest is recomputed
    assert after.num_rejected_blocks - before.num_rejected_blocks == 1
    assert after.num_imported_blocks - before.num_imported_blocks == 1
    assert after.num_free_blocks == after.num_total_blocks
    decode.check_integrity()


def test_an_import_that_fails_half_way_frees_what_it_took(engines, monkeypatch):
    _, prefill, decode = engines
    prompt = list(range(300, 370))  # 4 full blocks and a tail
    first, blocks = _prefill(prefill, prompt, "half-1")
    decode.generate([prompt[:32] + [7]], SamplingParams(max_tokens=1))  # 2 blocks to hold
    eng = decode.engine
    written = []
    real_write = eng.runner.write_blocks

    def write(blocks):  # two blocks land, then the device fails
        real_write(blocks[:2])
        written.extend(block_id for block_id, _ in blocks[:2])
        raise RuntimeError("device error")

    monkeypatch.setattr(eng.runner, "write_blocks", write)
    start = eng.stats().num_free_blocks
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert eng.begin_import(prompt, params, "half-1", first, None) == 2
    with pytest.raises(RuntimeError, match="device error"):
        eng.finish_import("half-1", {b.key: b.data for b in blocks})
    assert len(written) == 2
    assert eng.stats().num_free_blocks == start
    assert not eng.has_unfinished()
    decode.check_integrity()
