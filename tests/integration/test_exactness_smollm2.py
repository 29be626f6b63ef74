"""The real SmolLM2-135M-Instruct against transformers, float32 greedy, 48 new tokens.

One transformers reference per chat prompt (a few tokens up to 1,000+; the short ones
generated together, left-padded: ``hf_greedy(batched=True)``) serves every
engine configuration: alone and batched, prefix-cached, speculating in chunks, under a
JSON schema (the tiny models' tests add preemption and every other mode). Each difference must be a genuine near-tie of the reference; they
are printed.

The modes run on the plain (eager) model. The default step (compiled on the CPU, CUDA
graphs on a GPU) runs on SmolLM2's first two layers (its shapes, weights and kernels;
``first_layers_checkpoint``): inductor's cold compile of all 30 layers took 97 s of CPU
alone on an AVX2 EPYC (twice that beside the suite's other worker), of the first two
36 s. The tiny models' tests run every mode both ways.
"""

from __future__ import annotations

import json

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.testing.reference import CHATS, compare, hf_greedy

MAX_NEW = 48


def chat_prompts(path) -> list[list[int]]:
    """The token ids of every chat of ``CHATS`` under the checkpoint's chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    prompts = []
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] < 40 and lengths[-1] > 1000, lengths
    return prompts


@pytest.fixture(scope="module")
def refs(smollm2_path):
    return hf_greedy(smollm2_path, chat_prompts(smollm2_path), MAX_NEW, batched=True)


def _check(llm: LLM, refs, label: str) -> None:
    params = [
        SamplingParams(max_tokens=len(r.tokens), temperature=0, ignore_eos=True) for r in refs
    ]
    outs = llm.generate([r.prompt for r in refs], params)
    for k, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        tie = compare(out.token_ids, ref)
        if tie is not None:
            print(f"[{label}] request {k}: near-tie at token {tie}, gap {ref.gaps[tie]:.2e}")
    llm.check_integrity()
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats


def _llm(smollm2_path, enforce_eager: bool = False) -> LLM:
    return LLM(
        model=str(smollm2_path),
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory="512MiB",
        enforce_eager=enforce_eager,
    )


@pytest.fixture(scope="module")
def llm(smollm2_path):
    """The plain model: every mode below runs on it."""
    return _llm(smollm2_path, enforce_eager=True)


def test_all_prompts_together(llm, refs):
    _check(llm, refs, "together")


def test_the_default_step_on_the_first_two_layers(smollm2_path, tmp_path_factory):
    """The step the engine runs by default: compiled on the CPU (on CUDA, decode steps
    replay graphs)."""
    from pdserve.testing.tiny_models import first_layers_checkpoint

    path = first_layers_checkpoint(smollm2_path, 2, tmp_path_factory.mktemp("smollm2-2"))
    refs = hf_greedy(path, chat_prompts(path), MAX_NEW, batched=True)
    llm = _llm(path)
    assert llm.engine.runner.mode != "eager"
    _check(llm, refs, f"together, {llm.engine.runner.mode}, 2 layers")


def test_alone(llm, refs):
    shortest = min(refs, key=lambda r: len(r.prompt))
    longest = max(refs, key=lambda r: len(r.prompt))
    for ref in (shortest, longest):
        _check(llm, [ref], f"alone {len(ref.prompt)}")


def test_32_mixed_requests_together_hit_the_prefix_cache(llm, refs):
    # Each reference also gives the continuation of prompt + its first j tokens; their
    # prefixes were computed by the earlier runs, so this second run hits the cache.
    mixed = [refs[k % len(refs)].suffix((k * 5) % 40) for k in range(32)]
    assert len({len(r.prompt) for r in mixed}) > 20
    hits_before = llm.stats().prefix_cache_hits
    _check(llm, mixed, "batch32")
    assert llm.stats().prefix_cache_hits > hits_before


SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 4}'


def test_speculation_matches_transformers(smollm2_path, refs):
    """n-gram speculation over every prompt together, the longest prefilled in chunks of
    256, then 16 continuations that hit the prefix cache: the same tokens, and the drafts
    of the prompts that repeat themselves (the shipping log, the story) accepted. (The tiny
    models' tests run speculation in every mode, preemption included, both steps.)"""
    llm = LLM(
        model=str(smollm2_path),
        dtype="float32",
        max_model_len=2048,
        speculative_config=SPECULATIVE,
        enforce_eager=True,
        kv_cache_memory="512MiB",
        max_num_batched_tokens=256,
    )
    _check(llm, refs, "speculative, chunks of 256")
    stats = llm.stats()
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    mixed = [refs[k % len(refs)].suffix((k * 5) % 40) for k in range(16)]
    _check(llm, mixed, "speculative batch16")
    assert llm.stats().prefix_cache_hits > stats.prefix_cache_hits


@pytest.fixture(scope="module")
def json_refs(smollm2_path):
    """One chat per schema of pdserve.testing.schemas, asking for it; transformers' greedy
    output under each JSON schema (xgrammar's logits processor), stopping at EOS."""
    from transformers import AutoTokenizer

    from pdserve.core.sampling import StructuredOutputs
    from pdserve.testing.reference import hf_greedy_structured
    from pdserve.testing.schemas import PROMPTS, SCHEMAS, SUBJECTS

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompts, specs = [], []
    for k, (name, schema) in enumerate(SCHEMAS.items()):
        text = PROMPTS[name].format(subject=SUBJECTS[k]) + " Answer in JSON."
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        specs.append(StructuredOutputs(json=json.dumps(schema)))
    refs = hf_greedy_structured(smollm2_path, prompts, JSON_MAX_NEW, specs, batched=True)
    return list(zip(specs, refs, strict=True))


JSON_MAX_NEW = 80


def test_json_schemas_match_transformers(llm, refs, json_refs):
    """Five schemas' chats beside the unconstrained ones: each constrained output is
    transformers' under xgrammar's processor, and every one that ended parses as JSON."""
    params = [
        SamplingParams(max_tokens=JSON_MAX_NEW, temperature=0, structured_outputs=s)
        for s, _ in json_refs
    ]
    params += [
        SamplingParams(max_tokens=len(r.tokens), temperature=0, ignore_eos=True) for r in refs
    ]
    outs = llm.generate([r.prompt for _, r in json_refs] + [r.prompt for r in refs], params)
    for k, (out, ref) in enumerate(zip(outs, [r for _, r in json_refs] + refs, strict=True)):
        tie = compare(out.token_ids, ref)
        if tie is not None:
            print(f"[json] request {k}: near-tie at token {tie}, gap {ref.gaps[tie]:.2e}")
        elif k < len(json_refs) and out.finish_reason == "stop":
            json.loads(out.text)
    assert sum(o.finish_reason == "stop" for o in outs[: len(json_refs)]) >= 3
    llm.check_integrity()
