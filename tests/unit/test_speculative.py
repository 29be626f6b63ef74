"""Speculative decoding's parts without a model: the acceptance rule, n-gram lookup, the
config's checks, the counters and the switches."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.core.errors import SettingsError
from pdserve.core.sampling import SamplingParams
from pdserve.core.spec_stats import SpecDecodeStats
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode import (
    ACCEPTANCE_WINDOW,
    BACKOFF_STEPS,
    NgramProposer,
    SpecDecoder,
    accept_drafts,
)
from pdserve.settings.engine import EngineArgs
from pdserve.settings.speculative import SpeculativeConfig


@pytest.mark.parametrize(
    "drafts, draws, emitted",
    [
        ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all accepted, plus the bonus token
        ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # the target's token at the first difference
        ([5, 6, 7], [4, 6, 7, 8], [4]),  # none accepted: what decoding alone gives
        ([5], [5, 2], [5, 2]),
    ],
)
def test_the_accepted_prefix_then_the_targets_token(drafts, draws, emitted):
    assert accept_drafts(drafts, draws) == emitted


def _ngram(min_n=1, max_n=4):
    return NgramProposer(SpeculativeConfig(prompt_lookup_min=min_n, prompt_lookup_max=max_n))


def test_ngram_proposes_what_followed_the_longest_matching_suffix():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 7, 2, 3, 4, 5, 6, 1, 2, 3]
    # "1 2 3" (n=3) occurs at 0, followed by 9 7 2; "2 3" alone would also match at 5.
    assert _ngram().propose(tokens, 3) == [9, 7, 2]
    # Capped at 2: only "2 3" counts; its latest earlier occurrence is at 5 -> 4 5 6.
    assert _ngram(max_n=2).propose(tokens, 3) == [4, 5, 6]


def test_ngram_takes_the_latest_occurrence_and_stops_at_the_end():
    tokens = [7, 8, 1, 7, 8, 2, 7, 8]
    assert _ngram(min_n=2).propose(tokens, 4) == [2, 7, 8]
    assert _ngram(min_n=2).propose(tokens, 1) == [2]


def test_ngram_without_a_match_proposes_nothing():
    assert _ngram(min_n=2).propose([1, 2, 3, 4, 5], 4) == []
    assert _ngram().propose([1], 4) == []
    assert _ngram().propose([1, 2, 1], 0) == []


def test_config_defaults_and_vllm_spelling():
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (3, 5)
    assert config.prompt_lookup_min == 1
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).num_speculative_tokens == 2
    assert SpeculativeConfig.parse(config.to_json()) == config


@pytest.mark.parametrize(
    "value, named",
    [
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be in [1, 16], got 0"),
        ('{"num_speculative_tokens": "4"}', "num_speculative_tokens must be a int, got '4'"),
        ('{"method": "medusa"}', "method must be one of ngram, draft_model, got 'medusa'"),
        ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_max (2) must be"),
        ('{"prompt_lookup_min": 0}', "prompt_lookup_min must be >= 1"),
        ('{"disable_by_batch_size": 0}', "disable_by_batch_size must be >= 1"),
        ('{"min_acceptance_rate": 2}', "min_acceptance_rate must be in [0, 1]"),
        ('{"num_tokens": 4}', "unknown field(s) 'num_tokens'"),
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"model": "/m"}', '"model" applies to method "draft_model"'),
        ("{num_speculative_tokens: 4}", "must be a JSON object"),
        ("[1, 2]", "must be a JSON object, got list"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(value, named):
    with pytest.raises(SettingsError) as error:
        EngineArgs(speculative_config=value)
    assert named in str(error.value)
    assert "--speculative-config" in str(error.value)


def test_a_bad_config_stops_a_decode_worker_at_start():
    bad = json.dumps({"method": "ngram", "prompt_lookup_max": -1})
    res = subprocess.run(
        [sys.executable, "-m", "pdserve.decode", "--speculative-config", bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert "prompt_lookup_max (-1) must be >= prompt_lookup_min (1)" in res.stderr
    assert "Traceback" not in res.stderr


def test_counters_add_up():
    stats = SpecDecodeStats()
    stats.record(4, 4)
    stats.record(4, 1)
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 10, 5)
    assert stats.accepted_per_pos == [2, 1, 1, 1]
    assert stats.acceptance_rate == 0.5
    assert stats.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    total = SpecDecodeStats()
    total.add(stats)
    total.add(SpecDecodeStats(1, 6, 6, [1, 1, 1, 1, 1, 1]))
    assert total.accepted_per_pos == [3, 2, 2, 2, 1, 1]
    assert total.num_accepted_tokens == 11


def _seq(tokens, max_tokens=100, **params):
    """A request whose tokens are ``tokens``, the last one generated."""
    seq = Sequence("r", tokens[:-1], SamplingParams(max_tokens=max_tokens, **params))
    seq.append_token(tokens[-1])
    return seq


def test_proposals_leave_room_for_max_tokens_and_the_model_length():
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1000)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    spec.begin_step(1)
    assert spec.propose(_seq(tokens)) == [3, 4, 5, 6]
    assert spec.propose(_seq(tokens, max_tokens=3)) == [3]  # 1 generated, 1 draft + 1 bonus
    assert spec.propose(_seq(tokens, max_tokens=2)) == []
    near_end = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4), max_model_len=12)
    near_end.begin_step(1)
    assert near_end.propose(_seq(tokens)) == [3, 4, 5]  # 8 tokens, 3 drafts and 1 make 12


def test_requests_with_penalties_or_prefill_only_do_not_speculate():
    spec = SpecDecoder(SpeculativeConfig(), max_model_len=1000)
    assert spec.eligible(_seq([1, 2]))
    assert not spec.eligible(_seq([1, 2], repetition_penalty=1.1))
    prefill = _seq([1, 2])
    prefill.prefill_only = True
    assert not spec.eligible(prefill)


def test_the_batch_size_switch():
    spec = SpecDecoder(SpeculativeConfig(disable_by_batch_size=8), max_model_len=1000)
    assert spec.begin_step(8)
    assert not spec.begin_step(9)
    assert SpecDecoder(SpeculativeConfig(), max_model_len=1000).begin_step(10_000)


def test_a_request_whose_proposals_fail_backs_off_then_tries_again():
    spec = SpecDecoder(SpeculativeConfig(min_acceptance_rate=0.25), max_model_len=1000)
    seq = _seq([1, 2, 3, 1, 2])
    for _ in range(ACCEPTANCE_WINDOW):
        spec.begin_step(1)
        assert spec.propose(seq)
        spec.record(seq, 4, 0)
    for _ in range(BACKOFF_STEPS):
        spec.begin_step(1)
        assert spec.propose(seq) == []
    spec.begin_step(1)
    assert spec.propose(seq)
    # Failing again, it waits twice as long.
    for _ in range(ACCEPTANCE_WINDOW - 1):
        spec.record(seq, 4, 0)
        spec.begin_step(1)
    spec.record(seq, 4, 0)
    waited = 0
    while (spec.begin_step(1), spec.propose(seq))[1] == []:
        waited += 1
    assert waited == 2 * BACKOFF_STEPS
    # Accepted often enough, a request keeps proposing.
    good = _seq([1, 2, 3, 1, 2])
    good.request_id = "good"
    for _ in range(3 * ACCEPTANCE_WINDOW):
        spec.begin_step(1)
        assert spec.propose(good)
        spec.record(good, 4, 1)
    assert spec.stats.num_drafts == 5 * ACCEPTANCE_WINDOW
