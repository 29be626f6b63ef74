"""The grammar plumbing on the tiny tokenizer: compile errors are GrammarErrors, compiled
grammars are cached, a matcher follows appended tokens and refuses others, and a step's
masks of a speculating request follow its drafts (advanced, then rolled back)."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.core.sampling import SamplingParams, StructuredOutputs
from pdserve.engine.sequence import Sequence
from pdserve.engine.structured_output import GrammarCompiler, GrammarError, step_bitmask

CHOICE = StructuredOutputs(choice=("the fox", "the dog"))


@pytest.fixture(scope="module")
def compiler(tiny_llama_path):
    from pdserve.testing.tiny_models import TINY_VOCAB

    return GrammarCompiler(tiny_llama_path, TINY_VOCAB, [2])


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    from pdserve.core.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_llama_path)


@pytest.mark.parametrize(
    "spec, word",
    [
        (StructuredOutputs(regex="[.*"), "regex"),
        (StructuredOutputs(json=json.dumps({"type": "object", "properties": {"a": "b"}})), "JSON"),
        (StructuredOutputs(grammar="root ::= missing_rule"), "grammar"),
    ],
)
def test_a_bad_constraint_is_a_grammar_error(compiler, spec, word):
    with pytest.raises(GrammarError, match=word):
        compiler.compile(spec)


def test_compiled_grammars_are_cached(compiler):
    assert compiler.compile(CHOICE) is compiler.compile(
        StructuredOutputs(choice=["the fox", "the dog"])
    )
    assert compiler.is_cached(CHOICE)


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    bits = [(int(bitmask[row, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    return {t for t, b in enumerate(bits) if b}


def test_a_matcher_follows_appended_tokens(compiler, tokenizer):
    fox = tokenizer.encode("the fox", add_special_tokens=False)
    s = Sequence("r", [5], SamplingParams(structured_outputs=CHOICE))
    s.grammar = compiler.state(CHOICE)
    for t in fox:
        s.append_token(t)
    assert s.grammar.is_terminated is False
    with pytest.raises(ValueError, match="grammar"):
        s.append_token(fox[0])
    assert s.output_token_ids == fox  # the refused token was not appended
    s.append_token(2)  # EOS: the choice is complete
    assert s.grammar.is_terminated and s.check_stop(100) == "stop"


def test_a_speculating_requests_masks_follow_its_drafts(compiler, tokenizer):
    vocab = 512
    fox = tokenizer.encode("the fox", add_special_tokens=False)
    s = Sequence("r", [5], SamplingParams(structured_outputs=CHOICE))
    s.grammar = compiler.state(CHOICE)
    free = Sequence("u", [5], SamplingParams())
    drafts = {"r": fox[: len(fox) - 1]}
    rows = [s] * len(fox) + [free]
    offsets = list(range(len(fox))) + [0]
    bitmask, masked = step_bitmask(rows, offsets, drafts, vocab)
    assert masked == list(range(len(fox)))
    for k, token in enumerate(fox):
        assert token in allowed(bitmask, k, vocab)  # each position's mask after the drafts
    assert allowed(bitmask, len(fox), vocab) == set(range(vocab))  # the free row: all
    # Rolled back: the matcher is where it was.
    assert s.grammar.valid_prefix(fox) == len(fox)
    # A refused draft leaves the rows after it unmasked; the one before stays masked.
    bad = {"r": [fox[0], fox[0]]}
    bitmask, _ = step_bitmask([s] * 3, [0, 1, 2], bad, vocab)
    assert fox[0] not in allowed(bitmask, 1, vocab)
    assert allowed(bitmask, 2, vocab) == set(range(vocab))
    assert step_bitmask([free], [0], {}, vocab) is None


@pytest.mark.parametrize("name", ["tiny_llama_path", "smollm2_path"])
def test_the_vocabulary_is_xgrammars_own_description_of_it(request, name):
    """Workers describe the tokenizer to xgrammar from the Rust tokenizer alone; it is what
    xgrammar makes of transformers' (which the exactness references use)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pdserve.core.model import ModelConfig
    from pdserve.engine.structured_output import tokenizer_info

    path = request.getfixturevalue(name)
    cfg = ModelConfig.from_dir(path)
    eos = sorted(cfg.eos_token_ids)
    ours = tokenizer_info(path, cfg.vocab_size, eos)
    theirs = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(path), vocab_size=cfg.vocab_size, stop_token_ids=eos
    )
    for field in ("vocab_type", "add_prefix_space", "decoded_vocab", "stop_token_ids",
                  "special_token_ids", "vocab_size"):  # fmt: skip
        assert getattr(ours, field) == getattr(theirs, field), field
