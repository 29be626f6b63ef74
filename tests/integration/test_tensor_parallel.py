"""Tensor parallelism on this machine (gloo): a model split over two processes gives
transformers' float32 greedy output in every family and engine mode (batched, chunked,
preempted, prefix-cached; eager, and the tiny Llama compiled); blocks move between
engines of different TP sizes both ways, each rank importing only its KV heads; a rank
that dies ends its engine, and no process is left behind.

(test_tensor_parallel_cluster.py: the same through workers, `pdserve up` and a SIGKILL.)"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model import moe
from pdserve.engine.tensor_parallel import RankLost
from pdserve.testing.reference import generate_like_references, hf_greedy, random_prompts
from pdserve.testing.tiny_models import NEW_FAMILIES, build_tiny_checkpoint

FAMILIES = ["llama", "qwen2", *NEW_FAMILIES, "mistral"]
LENGTHS = [1, 5, 17, 40, 70, 130]
MAX_NEW = 24


@contextlib.contextmanager
def tp_llm(path, **args):
    llm = LLM(model=str(path), dtype="float32", tensor_parallel_size=2, **args)
    followers = llm.engine.followers
    try:
        yield llm
    finally:
        llm.engine.close()
        assert all(p.poll() is not None for p in followers.procs)  # none left behind


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, hf_greedy(path, random_prompts(3, LENGTHS), MAX_NEW)


# One family runs the compiled step (CUDA graphs on a GPU), its all-reduce an opaque op
# inside it; the others eager (a cold compile costs a CI run ~30 s).
COMPILED = "llama"


def test_tp2_matches_transformers_chunked_preempted_and_prefix_cached(family):
    """In chunks of 16 tokens, three sequences a step, in 14 blocks of 16 tokens (the
    longest request fits alone, not all at once: preemptions); then a continuation of the
    longest that hits the prefix cache."""
    kind, path, refs = family
    args = dict(enforce_eager=kind != COMPILED, max_num_batched_tokens=16, max_num_seqs=3)
    args.update(num_kv_blocks=14, max_model_len=192)
    if kind == "mistral":  # its blocks leave the window: fewer hold them all
        args.update(num_kv_blocks=10, max_model_len=160, max_num_seqs=6)
    with tp_llm(path, **args) as llm:
        runner = llm.engine.runner
        compiled = "compiled" if llm.engine.device.type == "cpu" else "cuda-graphs"
        assert runner.shard.size == 2
        assert runner.mode == (compiled if kind == COMPILED else "eager")
        calls = moe.counters["calls"]
        generate_like_references(llm, refs)
        assert llm.stats().num_preemptions > 0
        if kind in ("mixtral", "qwen3_moe"):
            assert moe.counters["calls"] > calls  # the routed expert op ran (rank 0's)
        if kind != "mistral":  # (its 10 blocks keep no prompt's start: it left the window)
            hits = llm.stats().prefix_cache_hits
            # The longest prompt ran last: its blocks are still cached.
            generate_like_references(llm, [refs[-1].suffix(9)])
            assert llm.stats().prefix_cache_hits > hits


def _prefill(llm: LLM, prompt, request_id):
    eng = llm.engine
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    seq = eng.add_request(prompt, params, request_id, prefill_only=True)
    while eng.has_unfinished():
        eng.step()
    return seq.output_token_ids[0], eng.export_prompt_blocks(request_id)


def _decode(llm: LLM, prompt, request_id, first, blocks):
    eng = llm.engine
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    fetched = {b.key: bytes(b.data) for b in blocks}
    seq = eng.add_imported_request(prompt, params, request_id, first, None, fetched)
    while eng.has_unfinished():
        eng.step()
    return seq


def test_blocks_move_between_tp_sizes_both_ways(tmp_path):
    """Prefill at TP 1, decode at TP 2, and back: transformers' tokens, every prompt block
    imported (none recomputed), and each decode rank imports its half of every block's
    heads only (counted by the rank itself)."""
    from pdserve.testing.reference import compare

    path = build_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    refs = hf_greedy(path, random_prompts(6, [17, 40, 70, 18, 41, 71]), MAX_NEW)
    ways = [refs[:3], refs[3:]]  # each way its own prompts: nothing cached from the other
    tp1 = LLM(model=str(path), dtype="float32", num_kv_blocks=128, enforce_eager=True)
    with tp_llm(path, num_kv_blocks=128, enforce_eager=True) as tp2:
        full = tp1.engine.block_layout()
        assert tp2.engine.block_layout() == full  # whole blocks on the wire, whatever TP
        for k, (src, dst) in enumerate([(tp1, tp2), (tp2, tp1)]):
            for i, ref in enumerate(ways[k]):
                rid = f"{k}-{i}"
                first, blocks = _prefill(src, ref.prompt, rid)
                assert all(len(b.data) == full.block_bytes for b in blocks)
                seq = _decode(dst, ref.prompt, rid, first, blocks)
                assert seq.num_imported_tokens == len(ref.prompt)
                compare(seq.output_token_ids, ref)
        blocks = sum(-(-len(r.prompt) // 16) for r in ways[0])
        half = full.block_bytes // 2
        assert tp2.stats().rank_imports == ((0, blocks, blocks * half), (1, blocks, blocks * half))
        for llm in (tp1, tp2):
            llm.check_integrity()


def test_a_dead_rank_ends_the_engine_and_leaves_nothing(tmp_path):
    """SIGKILL rank 1 between steps: the engine says which rank is gone, its next step
    raises RankLost (the engine thread's end, in a worker), and closing it leaves no
    process behind."""
    path = build_tiny_checkpoint("llama", tmp_path / "llama")
    with tp_llm(path, num_kv_blocks=64, enforce_eager=True) as llm:
        eng = llm.engine
        params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        eng.add_request(list(range(3, 40)), params, "doomed")
        eng.step()
        assert eng.lost_rank() is None
        (proc,) = eng.followers.procs
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while eng.lost_rank() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "rank 1" in eng.lost_rank() and "status -9" in eng.lost_rank()
        with pytest.raises(RankLost, match="collective failed"):
            eng.step()


def test_a_failure_of_rank_0_mid_step_ends_the_engine(tmp_path, monkeypatch):
    """An exception on rank 0 inside a step (here in the logits, after the forward's
    collectives) leaves the ranks out of step: the step raises RankLost, not the error, and
    closing kills the follower rather than waiting on it."""
    path = build_tiny_checkpoint("llama", tmp_path / "llama")
    with tp_llm(path, num_kv_blocks=64, enforce_eager=True) as llm:
        eng = llm.engine

        def broken(hidden, step):
            raise ValueError("injected")

        monkeypatch.setattr(eng.runner, "_logits", broken)
        eng.add_request(list(range(3, 20)), SamplingParams(max_tokens=4), "r")
        with pytest.raises(RankLost, match="rank 0 failed mid-step.*injected"):
            eng.step()
