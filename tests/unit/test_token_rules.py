"""Per-request token rules on a step's logits (allowed_token_ids, bad words, min_tokens,
logit_bias), and the sampler's refusal when they leave no token."""

from __future__ import annotations

import torch

from pdserve.core.sampling import SamplingParams
from pdserve.engine.logits_processors import apply_token_rules
from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import Sequence

VOCAB = 10
NEG = float("-inf")


def seq(output=(), **params) -> Sequence:
    s = Sequence("r", [1, 2], SamplingParams(max_tokens=20, **params), eos_token_ids=frozenset({9}))
    for t in output:
        s.append_token(t)
    return s


def rules(s: Sequence, offset: int = 0) -> torch.Tensor:
    logits = torch.zeros(1, VOCAB)
    apply_token_rules(logits, [s], [offset])
    return logits[0]


def test_no_rule_leaves_the_logits_alone():
    assert torch.equal(rules(seq()), torch.zeros(VOCAB))


def test_allowed_token_ids_keep_only_those():
    row = rules(seq(allowed_token_ids=[3, 5]))
    assert [i for i in range(VOCAB) if row[i] > NEG] == [3, 5]


def test_a_bad_word_is_never_completed():
    # "4 5": 5 is banned only right after a 4; a one-token word always.
    words = [(4, 5), (7,)]
    assert [i for i in range(VOCAB) if rules(seq((4,), bad_words_token_ids=words))[i] == NEG] == [
        5,
        7,
    ]
    assert [i for i in range(VOCAB) if rules(seq((3,), bad_words_token_ids=words))[i] == NEG] == [7]


def test_min_tokens_holds_back_eos_and_stop_tokens_until_reached():
    s = seq((1, 1), min_tokens=4, stop_token_ids=[6])
    assert [i for i in range(VOCAB) if rules(s)[i] == NEG] == [6, 9]
    assert [i for i in range(VOCAB) if rules(s, offset=1)[i] == NEG] == [6, 9]
    assert not (rules(s, offset=2) == NEG).any()  # the 5th token may stop
    ignoring = seq((1,), min_tokens=4, ignore_eos=True)
    assert not (rules(ignoring) == NEG).any()


def test_logit_bias_adds():
    row = rules(seq(logit_bias={2: 5.0, 8: -100.0}))
    assert row[2] == 5.0 and row[8] == -100.0 and row[0] == 0.0


def test_rules_that_leave_nothing_are_the_requests_error():
    s = seq(allowed_token_ids=[9], min_tokens=3, temperature=0)
    samples = Sampler()(torch.randn(1, VOCAB), [s])
    assert samples.tokens == [None]
    assert samples.errors[0].invalid and "no token may come next" in samples.errors[0].message
