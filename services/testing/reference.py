"""Hugging Face transformers as the ground truth for greedy output, and the near-tie rule."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

NEAR_TIE = 1e-4

# The chats of SmolLM2's float32 exactness test (tests/integration/test_exactness_smollm2.py),
# from a few tokens to 1,000+; bench/engine/bf16_agreement.py runs them in bf16.
_LONG_DOC = " ".join(
    f"Record {i}: the warehouse in district {i % 7} shipped {i * 37 % 101} crates of "
    f"{['apples', 'copper wire', 'notebooks', 'olive oil', 'bicycle parts'][i % 5]} on day {i}."
    for i in range(60)
)

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    [
        {"role": "system", "content": "You are a terse assistant who answers in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Give me three tips for learning to play the guitar."},
        {
            "role": "assistant",
            "content": "1. Practice daily. 2. Learn chords. 3. Play songs you love.",
        },
        {"role": "user", "content": "Expand on the second tip."},
    ],
    [{"role": "user", "content": "Traduis en français : « The weather is lovely today. »"}],
    [{"role": "user", "content": "List the planets of the solar system in order from the sun."}],
    [
        {
            "role": "user",
            "content": "Summarize the following shipping log in two sentences.\n\n" + _LONG_DOC,
        }
    ],
    [{"role": "user", "content": "Compute 17 * 23 and explain the steps."}],
    [{"role": "user", "content": "Tell me a short story about a robot who learns to paint. " * 8}],
]


@dataclass(frozen=True)
class Reference:
    """transformers' greedy continuation of a prompt, with the top-2 logit gap and the best
    logit at each step."""

    prompt: list[int]
    tokens: list[int]
    gaps: list[float]
    best: list[float]

    def first(self, n: int) -> Reference:
        """The same prompt's first ``n`` generated tokens."""
        return Reference(self.prompt, self.tokens[:n], self.gaps[:n], self.best[:n])

    def suffix(self, j: int) -> Reference:
        """The same continuation seen from prompt + first j generated tokens."""
        return Reference(
            self.prompt + self.tokens[:j], self.tokens[j:], self.gaps[j:], self.best[j:]
        )


def hf_greedy(
    model_path: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    repetition_penalty: float = 1.0,
    dtype: torch.dtype = torch.float32,
    batched: bool = False,
) -> list[Reference]:
    """Run transformers' ``generate`` (greedy, EOS ignored; float32 unless ``dtype`` says
    otherwise), one prompt at a time, or with ``batched`` prompts of similar lengths
    together, left-padded (`similar_lengths`): transformers' batched generation, whose
    float32 sums differ from the single prompt's in the last bits only (a different token
    only at a near-tie, which `compare` admits), for a fraction of the time where a pass
    costs the reading of the weights.

    With a repetition penalty, the gaps are those of the penalized scores the argmax saw
    (never batched: the penalty would count the padding).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # run the full length, as ignore_eos does
    if not batched or repetition_penalty != 1.0:
        return [
            _generate(model, prompt, max_new_tokens, repetition_penalty=repetition_penalty)
            for prompt in prompts
        ]
    out: dict[int, Reference] = {}
    for group in similar_lengths(prompts):
        refs = _generate_padded(model, [prompts[k] for k in group], max_new_tokens)
        out.update(zip(group, refs, strict=True))
    return [out[k] for k in range(len(prompts))]


def similar_lengths(prompts: list[list[int]], slack: int = 512) -> list[list[int]]:
    """Indices of ``prompts`` in groups of similar lengths: shortest first, a group grows
    while its padded size (count x longest) stays within 3x its tokens + ``slack``."""
    order = sorted(range(len(prompts)), key=lambda k: len(prompts[k]))
    groups: list[list[int]] = []
    for k in order:
        group = groups[-1] if groups else None
        if group is not None:
            tokens = sum(len(prompts[j]) for j in group) + len(prompts[k])
            if (len(group) + 1) * len(prompts[k]) <= 3 * tokens + slack:
                group.append(k)
                continue
        groups.append([k])
    return groups


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` as one batch for transformers' ``generate``: ids padded on the left with
    ``pad_id`` to the longest, and the attention mask that hides the padding."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _generate_padded(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    repetition_penalty: float = 1.0,
    processor=None,
    eos=(),
    **kwargs,
) -> list[Reference]:
    """transformers' greedy ``generate`` of ``prompts`` as one left-padded batch (one prompt:
    no padding). The gaps are those of the raw logits, or with a repetition penalty or a
    logits ``processor`` (one grammar per row) of the scores the argmax saw; a row's tokens
    end at its first of ``eos``, where generation stops for a prompt alone."""
    ids, mask = left_padded(prompts, pad_id=0)
    width = ids.shape[1]
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            output_scores=True,
            repetition_penalty=repetition_penalty,
            logits_processor=None if processor is None else [processor],
            return_dict_in_generate=True,
            pad_token_id=0,
            **kwargs,
        )
    plain = repetition_penalty == 1.0 and processor is None
    steps = out.logits if plain else out.scores
    refs = []
    for b, prompt in enumerate(prompts):
        tokens = out.sequences[b, width:].tolist()
        ends = [i for i, t in enumerate(tokens) if t in eos]
        if ends:
            del tokens[ends[0] + 1 :]
        top2 = [step[b].float().topk(2).values for step in steps[: len(tokens)]]
        refs.append(
            Reference(
                list(prompt),
                tokens,
                [float(t[0] - t[1]) for t in top2],
                [float(t[0]) for t in top2],
            )
        )
    return refs


def hf_greedy_structured(
    model_path: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    specs,
    batched: bool = False,
    **generate_kwargs,
) -> list[Reference]:
    """transformers' greedy ``generate`` (float32) under the grammar of ``specs`` (one
    ``StructuredOutputs`` for every prompt, or a list of one each), masked by xgrammar's own
    transformers logits processor, stopping at the model's EOS as the engine does. The gaps
    are those of the masked scores. ``batched``: prompts of similar lengths together,
    left-padded, each row under its own grammar (as ``hf_greedy``'s)."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor

    from pdserve.core.model import ModelConfig
    from pdserve.engine.structured_output import compile_spec

    cfg = ModelConfig.from_dir(model_path)
    eos = sorted(cfg.eos_token_ids)
    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(model_path), vocab_size=cfg.vocab_size, stop_token_ids=eos
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    specs = specs if isinstance(specs, list) else [specs] * len(prompts)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = eos
    if batched and not generate_kwargs:
        out: dict[int, Reference] = {}
        for group in similar_lengths(prompts):
            grammars = [compile_spec(compiler, specs[k]) for k in group]
            refs = _generate_padded(
                model,
                [prompts[k] for k in group],
                max_new_tokens,
                processor=LogitsProcessor(grammars if len(group) > 1 else grammars[0]),
                eos=set(eos),
            )
            out.update(zip(group, refs, strict=True))
        return [out[k] for k in range(len(prompts))]
    return [
        _generate(
            model,
            p,
            max_new_tokens,
            processor=LogitsProcessor(compile_spec(compiler, s)),
            **generate_kwargs,
        )
        for p, s in zip(prompts, specs, strict=True)
    ]


def _generate(model, prompt: list[int], max_new_tokens: int, **kwargs) -> Reference:
    """``_generate_padded`` of one prompt."""
    return _generate_padded(model, [prompt], max_new_tokens, **kwargs)[0]


def hf_greedy_tokens(model_path: Path, prompts: dict, max_new_tokens: int) -> dict:
    """``hf_greedy``'s tokens for each named prompt (name -> token ids)."""
    refs = hf_greedy(model_path, list(prompts.values()), max_new_tokens)
    return {name: r.tokens for name, r in zip(prompts, refs, strict=True)}


def compare(tokens: list[int], ref: Reference) -> int | None:
    """None if ``tokens`` equal the reference; else the index of a first difference that is a
    genuine near-tie (top-2 reference logits within NEAR_TIE). Fails the test otherwise."""
    n = min(len(tokens), len(ref.tokens))
    for i in range(n):
        if tokens[i] != ref.tokens[i]:
            assert ref.gaps[i] < NEAR_TIE, (
                f"token {i} differs: got {tokens[i]}, transformers {ref.tokens[i]} "
                f"(top-2 logit gap {ref.gaps[i]:.3g} is no near-tie)\n got {tokens}\n ref {ref.tokens}"
            )
            return i
    assert len(tokens) == len(ref.tokens), f"length {len(tokens)} != reference {len(ref.tokens)}"
    return None


def random_prompts(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    """Prompts of random token ids in [3, vocab) (past the tiny tokenizer's specials)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def generate_like_references(llm, refs: list[Reference]) -> None:
    """Run every reference's prompt through ``llm`` (greedy, its length, EOS ignored) and
    check the outputs: at most one near-tie difference, then the engine's blocks all free
    and its bookkeeping sound."""
    from pdserve.engine import SamplingParams

    params = [
        SamplingParams(max_tokens=len(r.tokens), temperature=0, ignore_eos=True) for r in refs
    ]
    outs = llm.generate([r.prompt for r in refs], params)
    ties = [compare(o.token_ids, r) for o, r in zip(outs, refs, strict=True)]
    assert ties.count(None) >= len(refs) - 1, f"too many near-tie differences: {ties}"
    llm.check_integrity()
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
