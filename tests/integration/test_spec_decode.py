"""Speculative decoding on tiny random models: exact against transformers (float32 greedy)
whatever the batching, chunking, caching and preemption; seeded sampling unchanged by it;
and the sampled distribution the target's, by a statistical test that a broken acceptance
rule fails.

A tiny random model seldom repeats itself, so n-gram lookup proposes little that it would
accept. These tests swap in proposers that know transformers' answer (and are wrong on
purpose every few proposals), so that verification accepts and rejects at every position;
SmolLM2 runs the real n-gram proposer (test_exactness_smollm2.py, test_openai_smollm2.py).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.kv_cache_manager import cdiv
from pdserve.engine.sampler import filtered_probs
from pdserve.kv.hashing import hash_block
from pdserve.testing.reference import generate_like_references, hf_greedy, random_prompts
from pdserve.testing.tiny_models import TINY_VOCAB
from tests.helpers.speculation import ReferenceProposer

MAX_NEW = 48
LENGTHS = [1, 3, 15, 16, 17, 40, 100, 160]
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tiny_llama_path, tiny_qwen2_path):
    path = tiny_llama_path if request.param == "llama" else tiny_qwen2_path
    return path, hf_greedy(path, random_prompts(11, LENGTHS), MAX_NEW)


def _speculating_llm(path, refs, **engine_args) -> tuple[LLM, ReferenceProposer]:
    llm = LLM(
        model=str(path),
        dtype="float32",
        speculative_config=engine_args.pop("speculative_config", NGRAM),
        **engine_args,
    )
    proposer = ReferenceProposer(refs, silent=frozenset({1, 5}))
    llm.engine.spec.proposer = proposer
    return llm, proposer


def _run(llm: LLM, refs) -> None:
    generate_like_references(llm, refs)
    stats = llm.stats()
    # The path really ran: drafts were verified, some accepted and some rejected.
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert len(stats.spec_accepted_per_pos) == 4 and stats.spec_accepted_per_pos[3] > 0


STEP_MODES = pytest.mark.parametrize("enforce_eager", [False, True], ids=["compiled", "eager"])


@STEP_MODES
@pytest.mark.parametrize(
    "engine_args",
    [
        dict(num_kv_blocks=512),  # everything together, speculating beside silent requests
        dict(num_kv_blocks=512, max_num_batched_tokens=7, max_num_seqs=3),  # tiny chunks
        dict(num_kv_blocks=512, block_size=4),  # drafts cross block boundaries
        # 24 blocks of 16 tokens: each request fits, all of them together do not.
        dict(num_kv_blocks=24, max_num_batched_tokens=64, max_model_len=256),
    ],
    ids=["batched", "chunked7", "block4", "preempt-chunked64"],
)
def test_speculation_matches_transformers(case, engine_args, enforce_eager):
    path, refs = case
    llm, _ = _speculating_llm(path, refs, enforce_eager=enforce_eager, **engine_args)
    _run(llm, refs)
    if engine_args["num_kv_blocks"] == 24:
        assert llm.stats().num_preemptions > 0


def test_speculation_on_prefix_cached_prompts(case):
    """Prompts and their own continuations come back: the prefix cache holds blocks that
    verified tokens filled, and only those."""
    path, refs = case
    llm, _ = _speculating_llm(path, refs, num_kv_blocks=512, block_size=8)
    _run(llm, refs)
    hits = llm.stats().prefix_cache_hits
    mixed = [refs[k % len(refs)].suffix((k * 7) % 40) for k in range(16)]
    llm.engine.spec.proposer = ReferenceProposer(mixed)
    _run(llm, mixed)
    assert llm.stats().prefix_cache_hits > hits
    # Every cached block's hash is that of tokens some request really has.
    known = set()
    for r in refs:
        tokens = r.prompt + r.tokens
        parent = None
        for i in range(len(tokens) // 8):
            parent = hash_block(
                parent, tokens[i * 8 : (i + 1) * 8], llm.engine.model_config.fingerprint
            )
            known.add(bytes(parent))
    cached = {bytes(h) for h in llm.engine.pool.cached_hashes()}
    assert cached and cached <= known


def test_rejected_drafts_give_their_blocks_back(tiny_llama_path):
    """Every proposal wrong: each step keeps one token, and the blocks the drafts took
    beyond the request's tokens return to the pool at once."""
    llm = LLM(
        model=str(tiny_llama_path),
        dtype="float32",
        num_kv_blocks=64,
        block_size=4,
        max_model_len=256,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 8, '
        '"min_acceptance_rate": 0}',
    )

    class Wrong:
        def propose(self, token_ids, k):
            return [(token_ids[-1] + 1 + j) % TINY_VOCAB for j in range(k)]

    llm.engine.spec.proposer = Wrong()
    engine = llm.engine
    seq = engine.add_request(list(range(3, 9)), SamplingParams(max_tokens=20, temperature=0))
    engine.step()  # the prompt
    while not seq.is_finished:
        engine.step()
        if not seq.is_finished:
            assert len(seq.block_table) == cdiv(seq.num_tokens, 4)
            assert seq.num_computed_tokens == seq.num_tokens - 1
            used = engine.pool.num_blocks - engine.pool.num_free_blocks
            assert used == len(seq.block_table)
    stats = llm.stats()
    assert stats.spec_num_drafts > 5 and stats.spec_num_accepted_tokens <= 1
    llm.check_integrity()
    plain = LLM(model=str(tiny_llama_path), dtype="float32", num_kv_blocks=64, max_model_len=256)
    want = plain.generate([list(range(3, 9))], SamplingParams(max_tokens=20, temperature=0))
    assert seq.output_token_ids == want[0].token_ids


def test_seeded_sampling_is_the_same_with_speculation_on_or_off(case):
    """A seeded draw depends on the seed and the token's index only, and speculation keeps
    the target's own draws: the output is the same token for token."""
    path, refs = case
    prompts = [r.prompt for r in refs]
    params = [
        SamplingParams(max_tokens=40, temperature=0.2, top_p=0.9, seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    plain = LLM(model=str(path), dtype="float32", num_kv_blocks=512)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm, _ = _speculating_llm(path, refs, num_kv_blocks=512)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    stats = llm.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


# --- the sampled distribution ---------------------------------------------------------

NUM_SAMPLES = 3000
ALPHA = 1e-3  # the test's significance level


def _chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness of fit, bins with an expected count under 5 pooled."""
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def _no_residual_rule(rng: random.Random):
    """A common mistake: accept a draft x with probability p(x), but after a rejection
    emit an ordinary draw from p (which may be x again) instead of one from the residual."""

    def rule(drafts, draws, logits, seq):
        probs = filtered_probs(logits.float(), [seq] * logits.shape[0])
        out = []
        for j, draft in enumerate(drafts):
            if rng.random() < float(probs[j, draft]):
                out.append(draft)
                continue
            out.append(draws[j])
            return out
        out.append(draws[len(drafts)])
        return out

    return rule


@pytest.fixture(scope="module")
def target(tiny_llama_path):
    """A prompt, a temperature at which the greedy draft is accepted about half the time,
    and transformers' exact distribution of the second generated token (the first one a
    decode step speculates on) at that temperature."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    prompt = [17, 250, 33, 401, 9, 128, 77, 300]
    with torch.inference_mode():
        first = model(torch.tensor([prompt])).logits[0, -1]
        pairs = torch.tensor([prompt + [t] for t in range(TINY_VOCAB)])
        second = model(pairs).logits[:, -1]  # [vocab of the first token, vocab]
    for temperature in (1.0, 0.5, 0.3, 0.2, 0.15, 0.1, 0.07):
        p1 = torch.softmax(first / temperature, -1)
        p2 = torch.softmax(second / temperature, -1)
        accept = float((p1 * p2.max(-1).values).sum())  # P(the greedy draft is drawn)
        if 0.3 <= accept <= 0.7:
            break
    else:
        raise AssertionError("no temperature gives the draft an acceptance near one half")
    marginal = (p1[:, None] * p2).sum(0)  # P(second token), over every first token
    return prompt, temperature, marginal, second.argmax(-1).tolist()


def _second_tokens(path, target, rule=None) -> tuple[torch.Tensor, object]:
    prompt, temperature, _, drafts_by_first = target
    llm = LLM(
        model=str(path),
        dtype="float32",
        num_kv_blocks=1024,
        max_num_seqs=256,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 1, '
        '"min_acceptance_rate": 0}',
    )

    class GreedyDraft:  # the target's own greedy choice: a perfect greedy draft model
        def propose(self, token_ids, k):
            return [drafts_by_first[token_ids[-1]]] if len(token_ids) == len(prompt) + 1 else []

    llm.engine.spec.proposer = GreedyDraft()
    if rule is not None:
        llm.engine.runner.acceptance_rule = rule
    params = [
        SamplingParams(max_tokens=3, temperature=temperature, seed=i, ignore_eos=True)
        for i in range(NUM_SAMPLES)
    ]
    outs = llm.generate([prompt] * NUM_SAMPLES, params)
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=TINY_VOCAB)
    return counts.double(), llm.stats()


def test_the_speculative_sampler_draws_from_the_target_distribution(tiny_llama_path, target):
    marginal = target[2]
    counts, stats = _second_tokens(tiny_llama_path, target)
    assert stats.spec_num_drafts == NUM_SAMPLES
    rate = stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
    assert 0.2 < rate < 0.8, rate  # both outcomes of the rule are exercised
    p = _chi2_pvalue(counts, NUM_SAMPLES * marginal.double())
    print(f"acceptance {rate:.2f}, chi-square p-value {p:.3g} (alpha {ALPHA})")
    assert p > ALPHA


def test_a_broken_acceptance_rule_fails_the_same_test(tiny_llama_path, target):
    marginal = target[2]
    counts, _ = _second_tokens(tiny_llama_path, target, _no_residual_rule(random.Random(0)))
    p = _chi2_pvalue(counts, NUM_SAMPLES * marginal.double())
    print(f"broken rule: chi-square p-value {p:.3g} (alpha {ALPHA})")
    assert p < ALPHA
    assert not math.isnan(p)
