"""Structured outputs against transformers, float32 greedy, on the tiny Llama and Qwen2: the
engine's output under a JSON schema, a regex and a choice equals transformers' ``generate``
masked by xgrammar's own transformers logits processor on the same grammar, token for token,
batched beside unconstrained requests, chunked, prefix-cached, preempted, speculating, and
handed over from a prefill-only engine to another (the grammar rebuilt from token ids).

The random models stay inside each grammar only because of the mask: every output is
checked to follow its grammar too (a JSON document, the regex, one of the choices)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from pdserve.core.finish_reason import FinishReason
from pdserve.core.sampling import StructuredOutputs
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.async_engine import AsyncEngine, Handover
from pdserve.kv.blocks import FetchedBlocks
from pdserve.testing.reference import compare, hf_greedy, hf_greedy_structured, random_prompts

MAX_NEW = 40
LENGTHS = [1, 5, 16, 33, 70, 150]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["fox", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
}
REGEX = r"(the|fox|dog)( (quick|lazy|brown|fox|dog)){2,9}\."
CHOICES = ("the quick fox", "the lazy dog", "pdserve serves tokens")
SPECS = {
    "json": StructuredOutputs(json=json.dumps(SCHEMA)),
    "regex": StructuredOutputs(regex=REGEX),
    "choice": StructuredOutputs(choice=CHOICES),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tiny_llama_path, tiny_qwen2_path):
    """(path, {spec name: references}, unconstrained references) of one tiny model."""
    path = tiny_llama_path if request.param == "llama" else tiny_qwen2_path
    prompts = random_prompts(11, LENGTHS)
    refs = {name: hf_greedy_structured(path, prompts, MAX_NEW, s) for name, s in SPECS.items()}
    free = hf_greedy(path, random_prompts(12, [3, 20, 90]), 24)
    return path, refs, free


def follows(name: str, text: str) -> bool:
    """Whether a finished output's text is in the grammar of SPECS[name]."""
    if name == "json":
        doc = json.loads(text)
        return set(doc) == {"name", "n", "tags"} and isinstance(doc["n"], int)
    if name == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


def constrained(name: str) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0, structured_outputs=SPECS[name])


def run_all(llm: LLM, refs, free) -> None:
    """Every spec's prompts, and the unconstrained ones, in one batch: each output as its
    reference's, every finished constrained one in its grammar, and the engine clean."""
    prompts, params, wants = [], [], []
    for name, rs in refs.items():
        prompts += [r.prompt for r in rs]
        params += [constrained(name)] * len(rs)
        wants += [(name, r) for r in rs]
    prompts += [r.prompt for r in free]
    params += [
        SamplingParams(max_tokens=len(r.tokens), temperature=0, ignore_eos=True) for r in free
    ]
    wants += [(None, r) for r in free]
    outs = llm.generate(prompts, params)
    ties = []
    for out, (name, ref) in zip(outs, wants, strict=True):
        tie = compare(out.token_ids, ref)
        ties.append(tie)
        if name is not None and tie is None and out.finish_reason == FinishReason.STOP:
            assert follows(name, out.text), (name, out.text)
    assert ties.count(None) >= len(ties) - 1, f"too many near-tie differences: {ties}"
    # Most constrained requests end by their grammar (EOS allowed only there).
    stops = sum(
        o.finish_reason == FinishReason.STOP for o, (n, _) in zip(outs, wants, strict=True) if n
    )
    assert stops >= len(refs["choice"]) + len(refs["regex"]) // 2, stops
    llm.check_integrity()
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats


STEP_MODES = pytest.mark.parametrize("enforce_eager", [False, True], ids=["compiled", "eager"])


@STEP_MODES
@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_batched_tokens=4096),
        dict(max_num_batched_tokens=7, max_num_seqs=3),
    ],
    ids=["batched", "chunked7"],
)
def test_constrained_output_matches_transformers(case, engine_args, enforce_eager):
    path, refs, free = case
    llm = LLM(
        model=str(path),
        dtype="float32",
        num_kv_blocks=512,
        enforce_eager=enforce_eager,
        **engine_args,
    )
    run_all(llm, refs, free)


def test_prefix_cache_hits_and_preemption_keep_constrained_output(case):
    path, refs, free = case
    # 24 blocks of 16: the longest request fits alone, not the batch: preemptions.
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=24, max_model_len=200)
    run_all(llm, refs, free)
    run_all(llm, refs, free)  # the prompts again: prefix-cache hits
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats


def test_speculation_keeps_constrained_output(case):
    """n-gram drafts under a grammar: those it refuses are cut before verification, the
    rest verified with the masks of their positions (the matcher advanced through the
    drafts before them, then rolled back)."""
    path, refs, free = case
    llm = LLM(
        model=str(path),
        dtype="float32",
        num_kv_blocks=512,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}',
    )
    run_all(llm, refs, free)
    stats = llm.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0, stats


def test_a_grammar_is_rebuilt_from_the_tokens_handed_over(case):
    """A prefill-only engine samples the first token under the mask and exports the
    prompt's blocks; a second engine takes the request with that first token (and, as a
    migrated stream, with tokens after it) and goes on inside the grammar, exactly."""
    path, refs, _ = case
    prefill, decode = (
        LLM(model=str(path), dtype="float32", num_kv_blocks=128),
        LLM(model=str(path), dtype="float32", num_kv_blocks=128),
    )
    ref = refs["json"][3]
    params = constrained("json")
    seq = prefill.engine.add_request(ref.prompt, params, "h", prefill_only=True)
    while prefill.engine.has_unfinished():
        prefill.engine.step()
    assert seq.output_token_ids == ref.tokens[:1]
    blocks = {b.key: b.data for b in prefill.engine.export_prompt_blocks("h")}
    engine = AsyncEngine(decode.engine)

    async def fetch(num_local: int) -> FetchedBlocks:
        return FetchedBlocks(dict(list(blocks.items())[num_local:]))

    async def generate(request_id: str, resumed: tuple[int, ...]) -> list[int]:
        handover = Handover(ref.tokens[0], None, fetch, resumed)
        deltas = [
            d async for d in engine.generate(request_id, ref.prompt, params, handover=handover)
        ]
        return [t for d in deltas for t in d.token_ids]

    try:
        assert asyncio.run(generate("d-1", ())) == ref.tokens[1:]
        assert asyncio.run(generate("d-2", tuple(ref.tokens[1:6]))) == ref.tokens[6:]
        with pytest.raises(ValueError, match="structured output grammar"):
            asyncio.run(generate("d-3", (ref.tokens[1], ref.tokens[1], ref.tokens[1])))
    finally:
        engine.shutdown()


def test_prompt_logprobs_are_the_prompt_tokens_logprobs(case):
    """prompt_logprobs: the logprob of each prompt token after the first, as transformers'
    forward gives it, whatever the chunking; the prefix cache is not used for them."""
    import torch
    from transformers import AutoModelForCausalLM

    path, refs, _ = case
    prompt = refs["json"][4].prompt
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    for budget in (4096, 9):
        llm = LLM(
            model=str(path), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=budget
        )
        for _ in range(2):  # the second run would hit the prefix cache
            (out,) = llm.generate(
                [prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
            )
            assert [lp.token_id for lp in out.prompt_logprobs] == prompt[1:]
            for p, lp in enumerate(out.prompt_logprobs):
                assert abs(lp.logprob - float(want[p, prompt[p + 1]])) < 1e-4
                top = want[p].topk(2)
                assert list(lp.top) == top.indices.tolist()
        llm.check_integrity()
