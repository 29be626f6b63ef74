"""Tiny random Llama (GQA, untied head) and Qwen2 (q/k/v biases) against transformers, float32 greedy."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM
from pdserve.engine.model import ops
from pdserve.testing.reference import (
    compare,
    generate_like_references,
    hf_greedy,
    random_prompts,
    similar_lengths,
)

MAX_NEW = 64
LENGTHS = [1, 2, 5, 15, 16, 17, 33, 64, 100, 150, 200, 255]


def _prompts(seed: int) -> list[list[int]]:
    return random_prompts(seed, LENGTHS)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tiny_llama_path, tiny_qwen2_path):
    path = tiny_llama_path if request.param == "llama" else tiny_qwen2_path
    prompts = _prompts(7)
    return path, hf_greedy(path, prompts, MAX_NEW)


def _run(llm: LLM, refs) -> None:
    generate_like_references(llm, refs)


# The compiled step (the default on the CPU) and the plain PyTorch model.
STEP_MODES = pytest.mark.parametrize("enforce_eager", [False, True], ids=["compiled", "eager"])


@STEP_MODES
@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_batched_tokens=4096),  # everything together
        dict(max_num_batched_tokens=64),  # chunked prefill
        dict(max_num_batched_tokens=7, max_num_seqs=3),  # tiny odd chunks, few seqs
        dict(block_size=8, max_num_batched_tokens=100),
        dict(enable_prefix_caching=False),
        dict(attention_backend="torch"),  # the reference kernels
    ],
    ids=["batched", "chunked64", "chunked7", "block8", "no-prefix-cache", "torch-attention"],
)
def test_matches_transformers(case, engine_args, enforce_eager):
    path, refs = case
    llm = LLM(
        model=str(path),
        dtype="float32",
        num_kv_blocks=512,
        enforce_eager=enforce_eager,
        **engine_args,
    )
    # On CUDA the torch reference attention runs eagerly: a graph cannot capture it.
    graph_less = (
        llm.engine.device.type == "cuda" and engine_args.get("attention_backend") == "torch"
    )
    assert (llm.engine.runner.mode == "eager") == (enforce_eager or graph_less)
    # The C++ ops wherever they build, with the C attention kernels they call.
    cpp = ops.cpu_ops_error() is None and llm.engine.runner.attn.name == "cpu"
    assert llm.engine.runner.cpp_ops == cpp
    _run(llm, refs)


@STEP_MODES
@pytest.mark.parametrize("max_num_batched_tokens", [4096, 64])
def test_the_python_ops_match_transformers(
    case, enforce_eager, max_num_batched_tokens, monkeypatch
):
    """The Python ops that a machine without the C++ operators runs."""
    path, refs = case
    monkeypatch.setenv("PDSERVE_CPU_OPS", "python")
    ops.cpu_ops_error.cache_clear()
    try:
        llm = LLM(
            model=str(path),
            dtype="float32",
            num_kv_blocks=512,
            enforce_eager=enforce_eager,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    finally:
        ops.cpu_ops_error.cache_clear()
    assert not llm.engine.runner.cpp_ops
    _run(llm, refs)


@STEP_MODES
def test_preemption_keeps_output(case, enforce_eager):
    path, refs = case
    # 22 blocks of 16 tokens: the longest sequence (255 + 64) fits alone, not all at once.
    llm = LLM(
        model=str(path),
        dtype="float32",
        num_kv_blocks=22,
        max_model_len=320,
        enforce_eager=enforce_eager,
    )
    _run(llm, refs)
    assert llm.stats().num_preemptions > 0


@STEP_MODES
def test_prefix_cache_hits_keep_output(case, enforce_eager):
    path, refs = case
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=512, enforce_eager=enforce_eager)
    _run(llm, refs)
    assert llm.stats().prefix_cache_hits == 0
    # Second run: the prompts and (mid-way) prompt + generated tokens hit the cache.
    _run(llm, refs)
    _run(llm, [r.suffix(9) for r in refs])
    assert llm.stats().prefix_cache_hits > 0


@pytest.mark.slow
def test_triton_backend_matches_transformers(case, request):
    """The Triton kernels inside the engine (the interpreter on a CPU, compiled on CUDA):
    Llama in chunks of 64 over blocks of 8, Qwen2 batched (the interpreter is slow)."""
    if request.node.callspec.params["case"] == "llama":
        engine_args = dict(max_num_batched_tokens=64, block_size=8)
    else:
        engine_args = dict(max_num_batched_tokens=4096)
    pytest.importorskip("triton")
    from pdserve.kernels.triton_attention import TRITON_AVAILABLE

    if not TRITON_AVAILABLE:
        pytest.skip("triton could not be loaded")
    path, refs = case
    llm = LLM(
        model=str(path),
        dtype="float32",
        num_kv_blocks=512,
        attention_backend="triton",
        # As on CUDA, where the plain model runs and CUDA graphs replay it: inductor
        # compiles only the CPU's step.
        enforce_eager=True,
        **engine_args,
    )
    assert llm.engine.runner.attn.name == "triton"
    # Four prompts (2 to 100 tokens: one a block exactly, one in two chunks), their first 12
    # tokens: the interpreter is slow.
    _run(llm, [refs[i].first(12) for i in (1, 4, 7, 8)])


def test_batched_references_are_the_single_prompt_ones(tiny_llama_path):
    """hf_greedy(batched=True), SmolLM2's reference: prompts of similar lengths generated
    together, left-padded, give each prompt's own greedy tokens (a difference only at a
    near-tie of the single-prompt run)."""
    prompts = random_prompts(5, [3, 9, 40, 41, 120, 700])
    assert similar_lengths(prompts) == [[0, 1, 2, 3, 4], [5]]
    single = hf_greedy(tiny_llama_path, prompts, 16)
    batched = hf_greedy(tiny_llama_path, prompts, 16, batched=True)
    for together, alone in zip(batched, single, strict=True):
        assert together.prompt == alone.prompt
        compare(together.tokens, alone)
