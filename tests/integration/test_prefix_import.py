"""The shared prefix tier's import into an engine (``LLMEngine.import_prefix``, tiny Llama,
float32): blocks another engine computed continue a prefix this engine's cache holds, the
request takes them all as hits and its output is transformers' ``generate``, even when the
pool must reuse free blocks to take them (the held prefix is not among those reused)."""

from __future__ import annotations

import random

from pdserve import LLM, SamplingParams
from pdserve.testing.reference import compare, hf_greedy
from pdserve.testing.tiny_models import build_tiny_checkpoint

BS = 16
MAX_NEW = 8


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_imported_prefix_blocks_are_hits_and_exact(tmp_path):
    path = build_tiny_checkpoint("llama", tmp_path / "llama")
    rng = random.Random(11)
    prompt = [rng.randrange(3, 512) for _ in range(6 * BS + 1)]  # 6 full blocks and 1 token
    other = [rng.randrange(3, 512) for _ in range(11 * BS + 1)]
    (ref,) = hf_greedy(path, [prompt], MAX_NEW)

    # The blocks as a prefill worker elsewhere computed them.
    donor = LLM(model=str(path), dtype="float32", num_kv_blocks=64, enforce_eager=True)
    donor.engine.add_request(prompt, _params(MAX_NEW), "donor", prefill_only=True)
    while donor.engine.has_unfinished():
        donor.engine.step()
    exported = donor.engine.export_prompt_blocks("donor")
    fetched = {b.key: bytes(b.data) for b in exported if b.num_tokens == BS}
    assert len(fetched) == 6

    llm = LLM(
        model=str(path), dtype="float32", num_kv_blocks=16, max_model_len=256, enforce_eager=True
    )
    engine = llm.engine
    llm.generate([prompt[: 2 * BS + 1]], _params(1))  # caches the prompt's first 2 blocks
    # A 12-block request after it: its freed blocks are younger than those 2, which now
    # head the free list, first in line for reuse.
    llm.generate([other], _params(1))
    assert len(engine.prefix_to_fetch(prompt)) == 4
    assert engine.import_prefix(prompt, fetched) == 4
    assert engine.prefix_to_fetch(prompt) == []  # all 6 cached: none evicted by the import

    hits = engine.stats().prefix_cache_hits
    (out,) = llm.generate([prompt], _params(MAX_NEW))
    assert engine.stats().prefix_cache_hits - hits == 6 * BS
    assert out.num_cached_tokens == 6 * BS
    assert compare(out.token_ids, ref) is None
    # Into an empty cache: a block of the wrong length is not imported, nor any after it.
    keys = [b.key for b in exported if b.num_tokens == BS]
    bad = {**fetched, keys[2]: fetched[keys[2]][:-4]}
    empty = LLM(
        model=str(path), dtype="float32", num_kv_blocks=16, max_model_len=256, enforce_eager=True
    )
    assert empty.engine.import_prefix(prompt, bad) == 2
    assert len(empty.engine.prefix_to_fetch(prompt)) == 4
