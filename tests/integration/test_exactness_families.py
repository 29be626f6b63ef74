"""Qwen3, Gemma 3, Mixtral, Qwen3-MoE, and a Mistral whose every layer slides: tiny random
checkpoints written by transformers (pdserve.testing.tiny_models), float32 greedy output
against transformers' ``generate`` in every engine mode; the sliding window's blocks
neither read nor held (test_families_cluster.py: the same models through a cluster).

Gemma 3's and the Mistral's window (TINY_WINDOW, 24 tokens) is shorter than most prompts:
the longest is over five windows long and generation runs past more."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM
from pdserve.engine.model import moe
from pdserve.testing.reference import compare, generate_like_references, hf_greedy, random_prompts
from pdserve.testing.tiny_models import NEW_FAMILIES, build_tiny_checkpoint
from tests.helpers.speculation import ReferenceProposer

FAMILIES = [*NEW_FAMILIES, "mistral"]
LENGTHS = [1, 5, 17, 40, 70, 130]
MAX_NEW = 24
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, hf_greedy(path, random_prompts(3, LENGTHS), MAX_NEW)


# Each mode an engine of its own; a compiled one per family (the compiled step is its own
# graph per architecture), the rest eager.
MODES = {
    # Everything batched together, compiled; then again, the prompts cached.
    "compiled-batched-prefix-cached": dict(),
    # Prefill in chunks of 7 tokens, at most 3 sequences a step.
    "chunked7": dict(enforce_eager=True, max_num_batched_tokens=7, max_num_seqs=3),
    # 14 blocks of 16 tokens: the longest request (130 + 24) fits alone, not all at once.
    "preempted": dict(enforce_eager=True, num_kv_blocks=14, max_model_len=192),
    # Blocks of 8, chunks of 64, the torch reference kernels.
    "torch-attention-block8": dict(
        enforce_eager=True, attention_backend="torch", block_size=8, max_num_batched_tokens=64
    ),
}


def _expected_mode(llm: LLM, args: dict) -> str:
    """The CPU compiles the step; CUDA replays graphs (bench/gpu/check.sh), except for a
    mixture of experts or the torch reference kernels, which run eagerly there."""
    if args.get("enforce_eager"):
        return "eager"
    if llm.engine.device.type != "cuda":
        return "compiled"
    runner = llm.engine.runner
    return "eager" if runner.cfg.is_moe or runner.attn.name == "torch" else "cuda-graphs"


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_modes_match_transformers(family, mode):
    kind, path, refs = family
    args = {"num_kv_blocks": 512, **MODES[mode]}
    if kind == "mistral" and mode == "preempted":
        # Its sequences give back the blocks that leave the window: 10 blocks hold the
        # window and a chunk of 16 for a few requests at once, not for all six.
        args.update(num_kv_blocks=10, max_model_len=160, max_num_batched_tokens=16)
    llm = LLM(model=str(path), dtype="float32", **args)
    assert llm.engine.runner.mode == _expected_mode(llm, args)
    calls = moe.counters["calls"]
    generate_like_references(llm, refs)
    if kind in ("mixtral", "qwen3_moe"):
        assert moe.counters["calls"] > calls  # the routed expert op ran
    if mode == "preempted":
        assert llm.stats().num_preemptions > 0
    if mode.endswith("prefix-cached"):
        assert llm.stats().prefix_cache_hits == 0
        generate_like_references(llm, refs)
        generate_like_references(llm, [r.suffix(9) for r in refs])
        assert llm.stats().prefix_cache_hits > 0


def test_speculation_matches_transformers(family):
    """n-gram speculation's verification path, fed transformers' continuations (one draft
    in three has a wrong token), in chunks of 64 tokens."""
    _, path, refs = family
    llm = LLM(
        model=str(path),
        dtype="float32",
        num_kv_blocks=512,
        enforce_eager=True,
        max_num_batched_tokens=64,
        speculative_config=NGRAM,
    )
    llm.engine.spec.proposer = ReferenceProposer(refs, silent=frozenset({1}))
    generate_like_references(llm, refs)
    stats = llm.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def _step_through(llm: LLM, prompt: list[int], max_tokens: int, after_step) -> list[int]:
    """Generate greedily for one prompt, calling ``after_step(seq)`` after each step."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seq = llm.engine.add_request(prompt, params, "windowed")
    while llm.engine.has_unfinished():
        llm.engine.step()
        if llm.engine.has_unfinished():
            after_step(seq)
    return list(seq.output_token_ids)


@pytest.mark.parametrize("chunk", [16, 4096], ids=["chunked16", "whole-prompt"])
def test_sliding_layers_never_read_past_their_window(tmp_path, chunk):
    """Gemma 3 (sliding, full, sliding): after every step the KV of every block wholly
    before the window is made NaN in the sliding layers' part of the cache. Were a sliding
    layer to read one, NaN would reach the logits; the output stays transformers'."""
    from pdserve.testing.tiny_models import TINY_WINDOW

    path = build_tiny_checkpoint("gemma3", tmp_path / "gemma3")
    prompt = random_prompts(5, [150])[0]  # over six windows
    (ref,) = hf_greedy(path, [prompt], 120)
    llm = LLM(
        model=str(path),
        dtype="float32",
        num_kv_blocks=64,
        enforce_eager=True,
        max_num_batched_tokens=chunk,
    )
    cfg, kv = llm.engine.runner.cfg, llm.engine.runner.kv
    sliding = [i for i, w in enumerate(cfg.layer_windows) if w]
    assert sliding == [0, 2] and cfg.release_window == 0  # a full layer keeps every block
    poisoned = 0

    def poison(seq) -> None:
        nonlocal poisoned
        first_seen = seq.num_computed_tokens - TINY_WINDOW + 1
        gone = seq.block_table[: max(first_seen, 0) // llm.engine.kv_cache.block_size]
        for layer in sliding:
            kv[gone, layer] = float("nan")
        poisoned = max(poisoned, len(gone))

    got = _step_through(llm, prompt, 120, poison)
    assert poisoned >= 10  # of the 17 blocks the sequence ends with
    compare(got, ref)  # fails unless equal or a genuine near-tie


def test_an_all_sliding_model_holds_a_bounded_number_of_blocks(tmp_path):
    """A Mistral whose every layer slides over TINY_WINDOW tokens: blocks that leave the
    window go back to the pool as the sequence grows, so the blocks held stay bounded
    while generating past many windows; the output stays transformers'."""
    from pdserve.testing.tiny_models import TINY_WINDOW

    path = build_tiny_checkpoint("mistral", tmp_path / "mistral")
    prompt = random_prompts(6, [100])[0]
    (ref,) = hf_greedy(path, [prompt], 300)  # 400 tokens: over 16 windows
    llm = LLM(
        model=str(path),
        dtype="float32",
        num_kv_blocks=64,
        enforce_eager=True,
        max_num_batched_tokens=32,
        max_model_len=512,
    )
    kv_cache = llm.engine.kv_cache
    assert kv_cache.window == TINY_WINDOW
    held = []
    got = _step_through(llm, prompt, 300, lambda seq: held.append(kv_cache.blocks_held(seq)))
    compare(got, ref)
    # The window and a chunk of 32 span at most 4 blocks of 16; one more is being filled.
    bound = -(-(TINY_WINDOW + 32) // 16) + 1
    assert max(held) <= bound, held
    assert len(held) > 250 and kv_cache.pool.num_free_blocks == 64
    llm.check_integrity()
